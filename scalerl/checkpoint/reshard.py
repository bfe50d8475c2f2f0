"""Resume a checkpoint under another layout or world size: FSDP at world 4 -> world 2, DP2xTP2 -> DP4,
distributed -> one process, one process -> distributed.

What is exact and what is not (recorded in each later checkpoint's ``meta.json`` as ``reshard_history``):

- exact: model weights, optimizer state (AdamW moments, step counts, param groups), LR scheduler, loss
  scaler, data position and step. DCP stores every tensor with its global shape, so any layout can read
  the chunks it owns; a single-process checkpoint is read whole and distributed by ``set_state_dict``.
- re-derived: the RNG streams (Python, NumPy, torch, the update shuffler). They were saved one per rank
  of the old layout and have no counterpart in the new one, so the trainer seeds them from
  ``(trainer.seed, step)``, alike on every rank as a fresh run seeds them
  (`scalerl.core.rng_state.reseed_after_reshard`): ranks that hold the same rows (a data-parallel rank's
  TP, SP and PP peers) must draw the same mini-batch shuffle, or their micro-batches differ and their
  collectives mismatch; data-parallel ranks differ by their rows. Rollout sampling draws from a seed per
  step and global row, so the samples of the first step after a resharded resume are those the old layout
  would have drawn, up to float summation order of the new layout; the update's mini-batch shuffle is not
  (its stream is new), so losses after a resharded resume are close, not bitwise.

Pipeline layouts are not resharded (their optimizer state is keyed per stage); they are refused, naming
both layouts. Every load checks the files' sha256 first and reads DCP with the restricted unpicklers of
`scalerl.checkpoint.dcp_safe_io`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from scalerl.checkpoint.config_match import check_config
from scalerl.checkpoint.dcp_safe_io import SafeFileSystemReader, dcp_load_safely
from scalerl.checkpoint.layout import (
    GRAD_SCALER_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    SHARDS_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    LoadedCheckpoint,
    load_torch_state,
    require_file,
    verify_files,
)
from scalerl.parallel.distributed import DistContext

SINGLE_PROCESS = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
EXACT = ["model weights", "optimizer state", "lr scheduler", "grad scaler", "data position", "step"]
RE_DERIVED = ["RNG streams (python, numpy, torch, update shuffler): from (trainer.seed, step), alike on every rank"]
_STAGE = re.compile(r"\.stage\d+(?=\.)")  # actor.stage1.layers.2.x (a pipeline stage) -> actor.layers.2.x


def saved_layout(meta: dict[str, Any]) -> dict[str, Any]:
    """``{"world_size", "layout"}`` of the run that wrote the checkpoint (single-process ones included)."""
    return meta.get("distributed") or {"world_size": 1, "layout": dict(SINGLE_PROCESS)}


def load_resharded(
    path: Path, meta: dict[str, Any], current: dict[str, Any], *, ctx: DistContext | None, model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None, expected_config: dict[str, Any] | None = None,
    strict_config_keys: list[str] | None = None, **_ignored: Any,
) -> LoadedCheckpoint:
    """Restore what is exact across layouts into this rank's objects (collective when distributed).
    ``current`` is this run's ``{"world_size", "layout"}``. RNG states are left for the caller to re-derive
    (named generators passed in are ignored, like the global ones)."""
    saved = saved_layout(meta)
    if saved["layout"]["pp"] > 1 or current["layout"]["pp"] > 1:
        raise CheckpointError(
            f"{path} was saved by {saved['world_size']} rank(s) with layout {saved['layout']}; this run has "
            f"{current['world_size']} with layout {current['layout']}: pipeline layouts are not resharded, "
            "resume with the same parallel.* settings"
        )
    if expected_config is not None:
        check_config(path, meta.get("config"), expected_config, strict_config_keys)
    distributed = "distributed" in meta
    verify_files(path, meta["files"], closed_dirs=(SHARDS_DIR,) if distributed else ())
    if distributed:
        _load_dcp(path, model, optimizer, ctx.group if ctx is not None else None)
    else:
        _load_single(path, model, optimizer, ctx)
    if scheduler is not None:
        scheduler.load_state_dict(load_torch_state(require_file(path, SCHEDULER_FILE)))
    if grad_scaler is not None:
        grad_scaler.load_state_dict(load_torch_state(require_file(path, GRAD_SCALER_FILE)))
    trainer_state = json.loads(require_file(path, TRAINER_STATE_FILE).read_text())
    if trainer_state.get("step") != meta["step"]:
        raise CheckpointError(f"{path / TRAINER_STATE_FILE} says step {trainer_state.get('step')} but meta.json "
                              f"says {meta['step']}")
    return LoadedCheckpoint(path=path, step=int(meta["step"]), trainer_state=trainer_state, meta=meta,
                            resharded_from=saved)


def reshard_record(step: int, saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """One ``reshard_history`` entry for meta.json: where the run changed layout and what that kept."""
    return {"step": step, "from": saved, "to": current, "exact": EXACT, "re_derived": RE_DERIVED}


# ------------------------------------------------------------------------------------------ DCP input
def saved_dcp_keys(shards: Path) -> set[str]:
    """The flattened keys a DCP checkpoint holds (``model.actor.x``, ``optim_pp0.state.actor.x.exp_avg``)."""
    return set(SafeFileSystemReader(shards).read_metadata().state_dict_metadata)


OPTIM_KEY = "optim_pp0"  # non-pipeline layouts keep one optimizer entry (see distributed._optim_key)


def _load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, group: Any = None) -> None:
    shards = path / SHARDS_DIR
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        request = {"model": model_state, OPTIM_KEY: optim_state}
    else:
        model_state = get_model_state_dict(model)
        request = {"model": model_state}
    _check_model_keys(path, {f"model.{k}" for k in model_state}, saved_dcp_keys(shards))
    dcp_load_safely(request, shards, process_group=group)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=request["model"], optim_state_dict=request[OPTIM_KEY])
    else:
        set_model_state_dict(model, request["model"])


def _check_model_keys(path: Path, wanted: set[str], saved: set[str]) -> None:
    saved_model = {k for k in saved if k.startswith("model.")}
    missing, unexpected = sorted(wanted - saved_model), sorted(saved_model - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit the model: missing {[k[6:] for k in missing][:5]}, "
            f"unexpected {[k[6:] for k in unexpected][:5]}"
        )


# ------------------------------------------------------------------------------- single-process input
def single_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-process checkpoint's model by name, tied names included."""
    file = require_file(path, MODEL_FILE)
    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(file))
    # save_model stores a tied tensor once and records {dropped name: kept name} in the metadata.
    tensors.update({dropped: tensors[kept] for dropped, kept in metadata.items()
                    if kept in tensors and dropped not in tensors})
    return tensors


def _load_single(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: DistContext) -> None:
    """A whole-model checkpoint into a sharded model, through the DCP path: rank 0 rewrites it as a DCP
    checkpoint beside it (``.tmp-<name>-reshard-w<N>``, removed after, or by the next start if killed),
    then every rank reads its shards. (``set_state_dict(full_state_dict=True)`` does this in memory but
    mismatches its collectives on a DP x TP mesh under gloo in torch 2.13.)"""
    scratch = path.parent / f".tmp-{path.name}-reshard-w{ctx.world_size}"
    if ctx.is_main:
        shutil.rmtree(scratch, ignore_errors=True)
        tensors = single_model_tensors(path)
        state: dict[str, Any] = {"model": tensors}
        if optimizer is not None:
            state[OPTIM_KEY] = _optimizer_by_name(load_torch_state(require_file(path, OPTIMIZER_FILE)))
        dcp.save(state, storage_writer=FileSystemWriter(str(scratch / SHARDS_DIR)), no_dist=True)
    ctx.barrier()
    try:
        _load_dcp(scratch, model, optimizer, ctx.group)
    finally:
        ctx.barrier()  # every rank has read before the copy goes
        if ctx.is_main:
            shutil.rmtree(scratch, ignore_errors=True)


def _optimizer_by_name(saved: dict[str, Any]) -> dict[str, Any]:
    """optimizer.pt keys state by parameter index; DCP (like ``get_state_dict``) by parameter name."""
    state, names = saved["state_dict"], saved["param_names"]
    index_to_name = {i: n for group, group_names in zip(state["param_groups"], names)
                     for i, n in zip(group["params"], group_names)}
    return {
        "state": {index_to_name[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": group_names} for group, group_names in zip(state["param_groups"], names)],
    }


# ------------------------------------------------------------------------------------- whole models
def read_full_model(path: Path, meta: dict[str, Any], targets: dict[str, torch.Tensor], prefix: str) -> None:
    """Fill ``targets`` (a single-process model's state dict, by name) from the ``prefix`` part (e.g.
    ``"actor."``) of any checkpoint: single-process, DCP of any layout, pipeline stages included.
    One process, no process group; the caller has verified the files."""
    if "distributed" not in meta:
        tensors = single_model_tensors(path)
        for name, target in targets.items():
            source = tensors.get(prefix + name)
            if source is None or source.shape != target.shape:
                raise CheckpointError(f"{path / MODEL_FILE} has no tensor {prefix + name} of shape {tuple(target.shape)}")
            target.copy_(source)
        return
    shards = path / SHARDS_DIR
    request: dict[str, torch.Tensor] = {}
    for key in saved_dcp_keys(shards):
        if key.startswith("model." + prefix):
            name = _STAGE.sub("", key[len("model."):], count=1)[len(prefix):]
            if name in targets:
                request[key[len("model."):]] = targets[name]  # tied copies of two stages load into one tensor
    missing = sorted(set(targets) - {_STAGE.sub("", k, count=1)[len(prefix):] for k in request})
    if missing:
        raise CheckpointError(f"{shards} holds no {prefix}{missing[0]} (and {len(missing) - 1} more tensors)")
    dcp_load_safely({"model": request}, shards)
