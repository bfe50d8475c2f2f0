"""Single-process checkpoints: one safetensors file of weights plus optimizer, scheduler, scaler and RNG.

Nothing is unpickled: tensors go through safetensors, the other ``.pt`` files are loaded with
``torch.load(..., weights_only=True)``. Loading validates everything (checksums, tensor names and
shapes, optimizer layout, config) before it touches the model, so a failed load changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model

import scalerl
from scalerl.checkpoint.atomic import (
    fsync_dir,
    fsync_file,
    prune,
    publish,
    remove_stale_temporaries,
    save_torch_state,
    write_durably,
)
from scalerl.checkpoint.config_match import canonical_json, check_config
from scalerl.checkpoint.layout import (
    FORMAT_VERSION,
    GRAD_SCALER_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    CheckpointError,
    LoadedCheckpoint,
    file_manifest,
    list_checkpoints,
    load_torch_state,
    read_meta,
    read_meta_or_none,
    require_file,
    step_dir_name,
    verify_files,
)
from scalerl.core.rng_state import capture_rng_state, restore_rng_state


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    generators: dict[str, torch.Generator] | None = None,
    trainer_state: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    keep_last: int | None = 3,
    model_config: dict[str, Any] | None = None,
    reshard_history: list[dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint ``root/step_<step>`` atomically and return its path.

    An existing checkpoint of the same step is replaced. Afterwards only the newest ``keep_last``
    complete checkpoints are kept (the one just written always stays; ``None`` keeps all).
    ``model_config`` (the HF config.json of the trained model) lets `export` rebuild it from the
    checkpoint alone; ``reshard_history`` records resumes under another layout (`reshard`).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    state = dict(trainer_state or {})
    if state.setdefault("step", step) != step:
        raise ValueError(f"trainer_state['step'] is {state['step']} but the checkpoint step is {step}")
    # Serialize the JSON parts first so a non-JSON-able value fails before anything touches disk.
    state_json = json.dumps(state, indent=2).encode()
    config_json = canonical_json(config) if config is not None else None

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    temp = root / f".tmp-{name}-{os.getpid()}"
    remove_stale_temporaries(root, keep=temp, is_complete=lambda p: read_meta_or_none(p) is not None)
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir()
    try:
        save_model(model, str(temp / MODEL_FILE), metadata={"format": "pt"})
        fsync_file(temp / MODEL_FILE)
        if optimizer is not None:
            save_torch_state(
                {"state_dict": optimizer.state_dict(), "param_names": _optimizer_param_names(optimizer, model)},
                temp / OPTIMIZER_FILE,
            )
        if scheduler is not None:
            save_torch_state(scheduler.state_dict(), temp / SCHEDULER_FILE)
        if grad_scaler is not None:
            save_torch_state(grad_scaler.state_dict(), temp / GRAD_SCALER_FILE)
        save_torch_state(capture_rng_state(generators or {}), temp / RNG_FILE)
        write_durably(temp / TRAINER_STATE_FILE, state_json)
        files = file_manifest(temp)
        meta = {
            "format_version": FORMAT_VERSION,
            "scalerl_version": scalerl.__version__,
            "torch_version": torch.__version__,
            "step": step,
            "saved_unix_time": time.time(),
            "config_fingerprint": hashlib.sha256(config_json.encode()).hexdigest() if config_json else None,
            "config": json.loads(config_json) if config_json else None,
            "model_config": model_config,
            "reshard_history": list(reshard_history or []),
            "files": files,
        }
        write_durably(temp / META_FILE, json.dumps(meta, indent=2).encode())  # last: marks it complete
        fsync_dir(temp)
        final = publish(temp, root / name)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    prune(list_checkpoints(root), keep_last, just_written=final)
    return final


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    generators: dict[str, torch.Generator] | None = None,
    restore_rng: bool = True,
    expected_config: dict[str, Any] | None = None,
    strict_config_keys: list[str] | None = None,
) -> LoadedCheckpoint:
    """Restore model, optimizer, scheduler and RNG states from the checkpoint at ``path``.

    ``restore_rng`` covers the global RNGs (Python, numpy, torch CPU and CUDA); the named
    ``generators`` passed in are restored either way (passing them is the request). With
    ``expected_config``, the keys in ``strict_config_keys`` (dotted paths into nested dicts; all keys
    when None) must equal the saved config. Raises `CheckpointError` naming what does not match,
    before any object is modified. The checkpoint itself is only read.
    """
    if strict_config_keys is not None and expected_config is None:
        raise ValueError("strict_config_keys needs expected_config")
    path = Path(path)
    meta = read_meta(path)
    verify_files(path, meta["files"])
    if expected_config is not None:
        check_config(path, meta.get("config"), expected_config, strict_config_keys)

    model_tensors = _read_model_tensors(path, model)
    optimizer_state = _read_optimizer_state(path, optimizer, model) if optimizer is not None else None
    scheduler_state = load_torch_state(require_file(path, SCHEDULER_FILE)) if scheduler is not None else None
    scaler_state = load_torch_state(require_file(path, GRAD_SCALER_FILE)) if grad_scaler is not None else None
    rng_state = load_torch_state(require_file(path, RNG_FILE))
    missing_generators = sorted(set(generators or {}) - set(rng_state["generators"]))
    if missing_generators:
        raise CheckpointError(
            f"{path / RNG_FILE} has no state for generator(s) {missing_generators}; "
            f"saved generators: {sorted(rng_state['generators'])}"
        )
    trainer_state = json.loads(require_file(path, TRAINER_STATE_FILE).read_text())
    if trainer_state.get("step") != meta["step"]:
        raise CheckpointError(
            f"{path / TRAINER_STATE_FILE} says step {trainer_state.get('step')} but meta.json says {meta['step']}"
        )

    # Everything is validated; only now modify the caller's objects.
    model.load_state_dict(model_tensors, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)
    if grad_scaler is not None:
        grad_scaler.load_state_dict(scaler_state)
    restore_rng_state(rng_state, generators or {}, restore_global=restore_rng)
    return LoadedCheckpoint(path=path, step=meta["step"], trainer_state=trainer_state, meta=meta)


def _read_model_tensors(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors keyed by every name in ``model.state_dict()``, after checking they fit."""
    file = require_file(path, MODEL_FILE)
    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata() or {}
    saved = load_file(str(file))
    # save_model stores a tied tensor once and records {dropped name: kept name} in the metadata.
    aliases = {dropped: kept for dropped, kept in metadata.items() if kept in saved and dropped not in saved}
    current = model.state_dict()
    problems, tensors = [], {}
    for name, tensor in current.items():
        source = name if name in saved else aliases.get(name)
        if source is None:
            problems.append(f"tensor {name!r} is missing from the checkpoint")
        elif saved[source].shape != tensor.shape:
            problems.append(
                f"tensor {name!r} has shape {tuple(saved[source].shape)} in the checkpoint "
                f"but {tuple(tensor.shape)} in the model"
            )
        elif saved[source].dtype != tensor.dtype:
            problems.append(f"tensor {name!r} is {saved[source].dtype} in the checkpoint but {tensor.dtype} in the model")
        else:
            tensors[name] = saved[source]
    problems += [f"unexpected tensor {name!r} in the checkpoint" for name in sorted(set(saved) - set(current))]
    problems += _tie_problems(current, saved)
    if problems:
        raise CheckpointError(f"{file} does not fit the model: " + "; ".join(problems))
    return tensors


def _tie_problems(current: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> list[str]:
    """Tied model weights stored as two separate tensors would silently load only one of them."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in current.items():
        if tensor.numel() and tensor.device.type != "meta":
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            groups.setdefault(key, []).append(name)
    return [
        f"tensors {stored} are tied in the model but stored separately in the checkpoint"
        for names in groups.values()
        if len(stored := [n for n in names if n in saved]) > 1
    ]


def _read_optimizer_state(path: Path, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    file = require_file(path, OPTIMIZER_FILE)
    saved = load_torch_state(file)
    saved_groups = saved["state_dict"]["param_groups"]
    current_groups = optimizer.state_dict()["param_groups"]
    if len(saved_groups) != len(current_groups):
        raise CheckpointError(
            f"{file} has {len(saved_groups)} parameter group(s) but the optimizer has {len(current_groups)}"
        )
    for index, (saved_group, current_group) in enumerate(zip(saved_groups, current_groups)):
        if len(saved_group["params"]) != len(current_group["params"]):
            raise CheckpointError(
                f"{file}: parameter group {index} has {len(saved_group['params'])} parameter(s) in the "
                f"checkpoint but {len(current_group['params'])} in the optimizer"
            )
    # Same counts can still hide a different parameter order; names catch that.
    for index, (saved_names, names) in enumerate(zip(saved["param_names"], _optimizer_param_names(optimizer, model))):
        for position, (saved_name, name) in enumerate(zip(saved_names, names)):
            if saved_name != name:
                raise CheckpointError(
                    f"{file}: parameter group {index}, position {position} is {saved_name!r} in the "
                    f"checkpoint but {name!r} in the optimizer"
                )
    return saved["state_dict"]


def _optimizer_param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """Model names of the optimizer's parameters per group, in order (tied weights: first name)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        [names.get(id(p), f"<unnamed parameter of shape {tuple(p.shape)}>") for p in group["params"]]
        for group in optimizer.param_groups
    ]
