"""Checkpoints: atomic files, single-process and distributed save/load behind one `save` / `load`, resume
lookup, and export of the trained model as a Hugging Face directory.

- `save(root, step, ..., ctx=ctx)` / `load(path, ..., ctx=ctx)`: one process writes one safetensors file
  (`local`); a distributed run writes per-rank shards with torch.distributed.checkpoint (`distributed`).
- `layout`: file names, `meta.json`, `list_checkpoints`, `latest_checkpoint`, `resolve_resume`.
- `atomic`: durable writes, sha256, publish-by-rename, pruning. `config_match`: resumed-config checks.
- `reshard`: resume under another layout or world size (weights and optimizer exact, RNG re-derived).
- `export`: `export_hf_model` writes an HF directory from any layout, gathering one tensor at a time
  (`streamed_export`: sharded and in the dtype like the source); `export_checkpoint` does it from any
  checkpoint on disk (`scalerl export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalerl.checkpoint.atomic import remove_stale_temporaries
from scalerl.checkpoint.distributed import (
    current_layout,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
)
from scalerl.checkpoint.export import export_checkpoint, export_hf_model
from scalerl.checkpoint.layout import (
    CheckpointError,
    LoadedCheckpoint,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
    read_meta_or_none,
    resolve_resume,
)
from scalerl.checkpoint.local import load_checkpoint, save_checkpoint
from scalerl.checkpoint.reshard import load_resharded, reshard_record, saved_layout
from scalerl.parallel.distributed import DistContext

__all__ = [
    "CheckpointError", "LoadedCheckpoint", "current_layout", "export_checkpoint", "export_hf_model", "latest_checkpoint",
    "list_checkpoints", "load", "load_checkpoint", "remove_interrupted_saves", "reshard_record",
    "resolve_resume", "save", "save_checkpoint",
]


def save(root: str | Path, step: int, *, ctx: DistContext | None = None, **state: Any) -> Path:
    """Write checkpoint ``root/step_<step>``: a single-process one, or (collective) per-rank shards.

    ``state``: model, optimizer, scheduler, grad_scaler, generators, trainer_state, config, keep_last."""
    if ctx is None or ctx.world_size == 1:
        return save_checkpoint(root, step, **state)
    return save_distributed_checkpoint(root, step, ctx=ctx, **state)


def load(path: str | Path, *, ctx: DistContext | None = None, **state: Any) -> LoadedCheckpoint:
    """Restore what `save` wrote into the given objects (collective when distributed).

    Under the layout that saved it, everything is restored bitwise, RNG streams included. Under another
    layout or world size (`reshard`), everything but the per-rank RNG streams is; the result's
    ``resharded_from`` then names the saving layout and the caller re-derives its RNG streams."""
    path = Path(path)
    meta = read_meta(path)
    current = current_layout(ctx)
    if saved_layout(meta) != current:
        return load_resharded(path, meta, current, ctx=ctx, **state)
    if ctx is None or ctx.world_size == 1:
        return load_checkpoint(path, **state)
    return load_distributed_checkpoint(path, ctx=ctx, **state)


def remove_interrupted_saves(root: str | Path) -> list[str]:
    """Put right what interrupted saves and prunes left in checkpoint root ``root`` (hidden ``.tmp-*``,
    ``.old-*``, ``.del-*`` directories); returns what was done. No save may be running there."""
    return remove_stale_temporaries(Path(root), keep=None, is_complete=lambda p: read_meta_or_none(p) is not None)
