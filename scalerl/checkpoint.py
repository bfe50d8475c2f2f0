"""Atomic training checkpoints: save, find the latest, resume bitwise-exactly.

Layout of one checkpoint (``root/step_00000012/``)::

    model.safetensors    weights; tied weights stored once (safetensors ``save_model`` semantics)
    optimizer.pt         {"state_dict", "param_names"}      (only when an optimizer is given)
    scheduler.pt         the LR scheduler's state_dict       (only when a scheduler is given)
    rng.pt               Python, numpy, torch CPU/CUDA and named torch.Generator states
    trainer_state.json   {"step", ...anything JSON-able the trainer passes (data position, ...)}
    meta.json            format version, versions, step, config + fingerprint, size and sha256 per file

Everything is written into ``root/.tmp-step_00000012-<pid>/``, fsynced, and only then renamed to its
final name, with ``meta.json`` written last: a directory called ``step_*`` is always complete, and a
crash mid-save leaves at most a hidden temporary directory that the next save deletes. One process
writes to a checkpoint root at a time (rank 0 once this grows a torch.distributed.checkpoint path).

Nothing is unpickled: tensors go through safetensors, the other ``.pt`` files are loaded with
``torch.load(..., weights_only=True)``. Loading validates everything (checksums, tensor names and
shapes, optimizer layout, config) before it touches the model, so a failed load changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model

import scalerl
from scalerl.rng_state import capture_rng_state, restore_rng_state

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
TRAINER_STATE_FILE = "trainer_state.json"
META_FILE = "meta.json"

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMP_PREFIXES = (".tmp-", ".old-", ".del-")  # hidden names used only while saving or pruning
_MISSING = "<absent>"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model/optimizer/config it is loaded into."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` hands back to the trainer after restoring the objects it was given."""

    path: Path
    step: int
    trainer_state: dict[str, Any]  # as saved, including "step"
    meta: dict[str, Any]


# ----------------------------------------------------------------------------------------------
# save


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    generators: dict[str, torch.Generator] | None = None,
    trainer_state: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    keep_last: int | None = 3,
) -> Path:
    """Write checkpoint ``root/step_<step>`` atomically and return its path.

    An existing checkpoint of the same step is replaced. Afterwards only the newest ``keep_last``
    complete checkpoints are kept (the one just written always stays; ``None`` keeps all).
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
    config_json = _canonical_json(config) if config is not None else None

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = _step_dir_name(step)
    temp = root / f".tmp-{name}-{os.getpid()}"
    _remove_stale_temporaries(root, keep=temp)
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir()
    try:
        save_model(model, str(temp / MODEL_FILE), metadata={"format": "pt"})
        _fsync_file(temp / MODEL_FILE)
        if optimizer is not None:
            _save_torch_state(
                {"state_dict": optimizer.state_dict(), "param_names": _optimizer_param_names(optimizer, model)},
                temp / OPTIMIZER_FILE,
            )
        if scheduler is not None:
            _save_torch_state(scheduler.state_dict(), temp / SCHEDULER_FILE)
        _save_torch_state(capture_rng_state(generators or {}), temp / RNG_FILE)
        _write_durably(temp / TRAINER_STATE_FILE, state_json)
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(temp.iterdir())
        }
        meta = {
            "format_version": FORMAT_VERSION,
            "scalerl_version": scalerl.__version__,
            "torch_version": torch.__version__,
            "step": step,
            "saved_unix_time": time.time(),
            "config_fingerprint": hashlib.sha256(config_json.encode()).hexdigest() if config_json else None,
            "config": json.loads(config_json) if config_json else None,
            "files": files,
        }
        _write_durably(temp / META_FILE, json.dumps(meta, indent=2).encode())  # last: marks it complete
        _fsync_dir(temp)
        final = _publish(temp, root / name)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _prune(root, keep_last, just_written=final)
    return final


def _publish(temp: Path, final: Path) -> Path:
    """Rename the finished temporary directory to its final name, replacing an older copy."""
    old = None
    if final.exists():
        # A directory cannot be renamed over a non-empty one: move the old copy aside first. If we die
        # between the two renames, `_remove_stale_temporaries` moves the old copy back.
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(temp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _prune(root: Path, keep_last: int | None, just_written: Path) -> None:
    if keep_last is None:
        return
    others = [p for p in list_checkpoints(root) if p != just_written]
    for path in others[: max(len(others) - (keep_last - 1), 0)]:
        # Rename first: a half-deleted directory must never still look like a checkpoint.
        doomed = path.with_name(f".del-{path.name}-{os.getpid()}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_temporaries(root: Path, keep: Path) -> None:
    """Delete what an interrupted save or prune left behind (one writer per root, so none is live)."""
    for path in root.iterdir():
        if path == keep or not path.name.startswith(_TEMP_PREFIXES) or not path.is_dir():
            continue
        if path.name.startswith(".old-"):
            original = root / path.name[len(".old-") :].rsplit("-", 1)[0]
            if not original.exists() and _read_meta_or_none(path) is not None:
                os.rename(path, original)  # died between "move old away" and "move new in"
                continue
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# find


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``step_*`` directory with a valid meta.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            meta = _read_meta_or_none(path)
            if meta is not None and meta.get("step") == int(match.group(1)):
                found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str | os.PathLike | None, root: str | os.PathLike) -> Path | None:
    """Turn a ``resume`` setting into a checkpoint path.

    ``"auto"``: the latest checkpoint under ``root``, or None when there is none;
    ``"never"``, ``""`` or None: None; anything else: that checkpoint directory (must be complete).
    """
    if resume is None or str(resume).strip() in ("", "never"):
        return None
    if str(resume).strip() == "auto":
        return latest_checkpoint(root)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"resume checkpoint {str(path)!r} does not exist or is not a directory")
    _read_meta(path)
    return path


# ----------------------------------------------------------------------------------------------
# load


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
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
    meta = _read_meta(path)
    _verify_files(path, meta)
    if expected_config is not None:
        _check_config(path, meta.get("config"), expected_config, strict_config_keys)

    model_tensors = _read_model_tensors(path, model)
    optimizer_state = _read_optimizer_state(path, optimizer, model) if optimizer is not None else None
    scheduler_state = _load_torch_state(_require(path, SCHEDULER_FILE)) if scheduler is not None else None
    rng_state = _load_torch_state(_require(path, RNG_FILE))
    missing_generators = sorted(set(generators or {}) - set(rng_state["generators"]))
    if missing_generators:
        raise CheckpointError(
            f"{path / RNG_FILE} has no state for generator(s) {missing_generators}; "
            f"saved generators: {sorted(rng_state['generators'])}"
        )
    trainer_state = json.loads(_require(path, TRAINER_STATE_FILE).read_text())
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
    restore_rng_state(rng_state, generators or {}, restore_global=restore_rng)
    return LoadedCheckpoint(path=path, step=meta["step"], trainer_state=trainer_state, meta=meta)


def _read_model_tensors(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors keyed by every name in ``model.state_dict()``, after checking they fit."""
    file = _require(path, MODEL_FILE)
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
    file = _require(path, OPTIMIZER_FILE)
    saved = _load_torch_state(file)
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


def _check_config(path: Path, saved: dict | None, expected: dict, keys: list[str] | None) -> None:
    saved = saved or {}
    expected = json.loads(_canonical_json(expected))  # tuples -> lists etc., as the saved copy went
    if keys is None:
        keys = sorted(set(_flatten(saved)) | set(_flatten(expected)))
    mismatches = [
        f"{key!r}: saved {_lookup(saved, key)!r}, current {_lookup(expected, key)!r}"
        for key in keys
        if _lookup(saved, key) != _lookup(expected, key)
    ]
    if mismatches:
        raise CheckpointError(f"config of checkpoint {path} does not match: " + "; ".join(mismatches))


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _lookup(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


# ----------------------------------------------------------------------------------------------
# files


def _step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {META_FILE} is missing")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{meta_file} is unreadable: {error}") from error
    if not isinstance(meta, dict) or not {"format_version", "step", "files"} <= set(meta):
        raise CheckpointError(f"{meta_file} lacks format_version/step/files")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_file} has format version {meta['format_version']}; this scalerl reads up to {FORMAT_VERSION}"
        )
    return meta


def _read_meta_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return _read_meta(path)
    except CheckpointError:
        return None


def _verify_files(path: Path, meta: dict[str, Any]) -> None:
    for name, expected in meta["files"].items():
        file = _require(path, name)
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} is corrupt: {size} bytes, meta.json recorded {expected['bytes']}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from the one in meta.json")


def _require(path: Path, name: str) -> Path:
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is missing {name}")
    return file


def _save_torch_state(obj: Any, file: Path) -> None:
    with open(file, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _load_torch_state(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure here means the file cannot be trusted
        raise CheckpointError(f"{file} cannot be loaded safely: {error}") from error


def _write_durably(file: Path, data: bytes) -> None:
    with open(file, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_file(file: Path) -> None:
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make renames and new entries in ``directory`` durable (a no-op where directories can't be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical_json(obj: Any) -> str:
    """Key-sorted JSON; non-JSON leaves (paths, enums) become strings so the fingerprint is stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
