"""Distributed checkpoints: `torch.distributed.checkpoint` (DCP) for sharded model and optimizer state, in the
same directory layout and with the same atomic publish, pruning and `resume=auto` as single-process ones.

Every rank writes its own shards (FSDP/TP DTensors, pipeline stages) and its own RNG state; rank 0 writes
the scheduler, trainer state and `meta.json` last, then renames the finished temporary directory into place.
`meta.json` records the layout; under the same layout a load restores everything bitwise, RNG streams
included; under another one `scalerl.checkpoint.reshard` takes over (the RNG streams are per rank and
cannot follow). Loading checks every
file against the sizes and sha256s in `meta.json` first and never unpickles without restriction
(`scalerl.checkpoint.dcp_safe_io`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import scalerl
from scalerl.checkpoint.atomic import prune, publish, save_torch_state, write_durably
from scalerl.checkpoint.config_match import canonical_json, check_config
from scalerl.checkpoint.dcp_safe_io import dcp_load_safely
from scalerl.checkpoint.layout import (
    FORMAT_VERSION,
    GRAD_SCALER_FILE,
    META_FILE,
    SCHEDULER_FILE,
    SHARDS_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    LoadedCheckpoint,
    file_manifest,
    list_checkpoints,
    load_torch_state,
    read_meta,
    step_dir_name,
    verify_files,
)
from scalerl.core.rng_state import capture_rng_state, restore_rng_state
from scalerl.parallel.distributed import DistContext


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _optim_key(ctx: DistContext) -> str:
    """DCP stores non-tensor entries (optimizer param_groups) once per key; pipeline ranks have different
    groups, so each pipeline rank gets its own key (DP/TP peers share theirs)."""
    pp_rank = ctx.mesh["pp"].get_local_rank() if ctx.mesh is not None and ctx.dims.pp > 1 else 0
    return f"optim_pp{pp_rank}"


def _layout(ctx: DistContext) -> dict[str, int]:
    d = ctx.dims
    return {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp}


def current_layout(ctx: DistContext | None) -> dict[str, Any]:
    """``{"world_size", "layout"}`` of this run, as meta.json records it (one process: all sizes 1)."""
    if ctx is None or ctx.world_size == 1:
        return {"world_size": 1, "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}}
    return {"world_size": ctx.world_size, "layout": _layout(ctx)}


def save_distributed_checkpoint(
    root: str | os.PathLike, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    generators: dict[str, torch.Generator], trainer_state: dict[str, Any], config: dict[str, Any],
    keep_last: int, ctx: DistContext, grad_scaler: torch.amp.GradScaler | None = None,
    model_config: dict[str, Any] | None = None, reshard_history: list[dict[str, Any]] | None = None,
) -> Path:
    """Collective: every rank calls it. ``model`` holds this rank's trainable modules (unwrapped)."""
    root = Path(root)
    final = root / step_dir_name(step)
    temp = root / f".tmp-{final.name}-dist"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
    ctx.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, _optim_key(ctx): optim_state}, checkpoint_id=str(temp / SHARDS_DIR),
             process_group=ctx.group)
    save_torch_state(capture_rng_state(generators), temp / _rng_file(ctx.rank))
    ctx.barrier()  # every shard and RNG file is on disk before rank 0 declares the checkpoint complete
    if ctx.is_main:
        save_torch_state(scheduler.state_dict(), temp / SCHEDULER_FILE)
        if grad_scaler is not None:  # the scale is the same on every rank (found-inf is all-reduced)
            save_torch_state(grad_scaler.state_dict(), temp / GRAD_SCALER_FILE)
        write_durably(temp / TRAINER_STATE_FILE, json.dumps({**trainer_state, "step": step}, indent=2).encode())
        config_json = canonical_json(config)
        files = file_manifest(temp)
        meta = {
            "format_version": FORMAT_VERSION, "scalerl_version": scalerl.__version__,
            "torch_version": torch.__version__, "step": step, "saved_unix_time": time.time(),
            "config": json.loads(config_json), "distributed": {"world_size": ctx.world_size, "layout": _layout(ctx)},
            "model_config": model_config, "reshard_history": list(reshard_history or []), "files": files,
        }
        write_durably(temp / META_FILE, json.dumps(meta, indent=2).encode())  # last: marks it complete
        publish(temp, final)
        prune(list_checkpoints(root), keep_last, just_written=final)
    ctx.barrier()
    return final


def load_distributed_checkpoint(
    path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    generators: dict[str, torch.Generator], expected_config: dict[str, Any], strict_config_keys: list[str],
    ctx: DistContext, grad_scaler: torch.amp.GradScaler | None = None,
) -> LoadedCheckpoint:
    """Collective: restore this rank's shards, optimizer state, RNG streams; returns the trainer state."""
    path = Path(path)
    meta = read_meta(path)
    saved = meta.get("distributed")
    if saved is None:
        raise CheckpointError(f"{path} is a single-process checkpoint; resume it with a single process")
    if saved["world_size"] != ctx.world_size or saved["layout"] != _layout(ctx):
        raise CheckpointError(
            f"{path} was saved by {saved['world_size']} ranks with layout {saved['layout']}; this run has "
            f"{ctx.world_size} ranks with layout {_layout(ctx)}: resume with the same parallel.* settings"
        )
    check_config(path, meta.get("config"), expected_config, strict_config_keys)
    rng_file = path / _rng_file(ctx.rank)
    if not rng_file.is_file():
        raise CheckpointError(f"{path} has no {rng_file.name}: the checkpoint is incomplete")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, _optim_key(ctx): optim_state}
    # Checksums before DCP reads a byte, then DCP without unrestricted unpickling.
    verify_files(path, meta["files"], closed_dirs=(SHARDS_DIR,))
    dcp_load_safely(state, path / SHARDS_DIR, process_group=ctx.group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state[_optim_key(ctx)])
    scheduler.load_state_dict(load_torch_state(path / SCHEDULER_FILE))
    if grad_scaler is not None:
        grad_scaler.load_state_dict(load_torch_state(path / GRAD_SCALER_FILE))
    restore_rng_state(load_torch_state(rng_file), generators, restore_global=True)
    trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text())
    ctx.barrier()
    return LoadedCheckpoint(path=path, step=int(meta["step"]), trainer_state=trainer_state, meta=meta)
