"""Checkpoints: atomic files, single-process and distributed save/load behind one `save` / `load`, resume
lookup, and export of the trained model as a Hugging Face directory.

- `save(root, step, ..., ctx=ctx)` / `load(path, ..., ctx=ctx)`: one process writes one safetensors file
  (`local`); a distributed run writes per-rank shards with torch.distributed.checkpoint (`distributed`).
- `layout`: file names, `meta.json`, `list_checkpoints`, `latest_checkpoint`, `resolve_resume`.
- `atomic`: durable writes, sha256, publish-by-rename, pruning. `config_match`: resumed-config checks.
- `export`: `export_hf_model` gathers full weights from any layout and writes an HF directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalerl.checkpoint.distributed import load_distributed_checkpoint, save_distributed_checkpoint
from scalerl.checkpoint.export import export_hf_model
from scalerl.checkpoint.layout import (
    CheckpointError, LoadedCheckpoint, latest_checkpoint, list_checkpoints, resolve_resume,
)
from scalerl.checkpoint.local import load_checkpoint, save_checkpoint
from scalerl.parallel.distributed import DistContext

__all__ = [
    "CheckpointError", "LoadedCheckpoint", "export_hf_model", "latest_checkpoint", "list_checkpoints", "load",
    "load_checkpoint", "resolve_resume", "save", "save_checkpoint",
]


def save(root: str | Path, step: int, *, ctx: DistContext | None = None, **state: Any) -> Path:
    """Write checkpoint ``root/step_<step>``: a single-process one, or (collective) per-rank shards.

    ``state``: model, optimizer, scheduler, grad_scaler, generators, trainer_state, config, keep_last."""
    if ctx is None or ctx.world_size == 1:
        return save_checkpoint(root, step, **state)
    return save_distributed_checkpoint(root, step, ctx=ctx, **state)


def load(path: str | Path, *, ctx: DistContext | None = None, **state: Any) -> LoadedCheckpoint:
    """Restore what `save` wrote into the given objects (collective when distributed)."""
    if ctx is None or ctx.world_size == 1:
        return load_checkpoint(path, **state)
    return load_distributed_checkpoint(path, ctx=ctx, **state)
