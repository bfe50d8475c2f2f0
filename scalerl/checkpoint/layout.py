"""What a checkpoint directory is: its file names, `meta.json`, and how complete checkpoints are found.

Layout of one checkpoint (``root/step_00000012/``)::

    model.safetensors    weights (single process); ``dcp/`` holds per-rank shards in a distributed one
    optimizer.pt         {"state_dict", "param_names"}      (single process, when an optimizer is given)
    scheduler.pt         the LR scheduler's state_dict
    grad_scaler.pt       the fp16 loss scaler's state_dict   (when one is in use)
    rng.pt / rng_rankNNNNN.pt   Python, numpy, torch CPU/CUDA and named torch.Generator states
    trainer_state.json   {"step", ...anything JSON-able the trainer passes (data position, ...)}
    meta.json            format version, versions, step, config + fingerprint, size and sha256 per file

``meta.json`` is written last: a directory called ``step_*`` with a readable ``meta.json`` is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from scalerl.checkpoint.atomic import sha256_of

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
GRAD_SCALER_FILE = "grad_scaler.pt"
RNG_FILE = "rng.pt"
TRAINER_STATE_FILE = "trainer_state.json"
META_FILE = "meta.json"
SHARDS_DIR = "dcp"  # per-rank DCP shards of a distributed checkpoint

_STEP_DIR = re.compile(r"^step_(\d+)$")
_log = logging.getLogger("scalerl.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model/optimizer/config it is loaded into."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What a load hands back to the trainer after restoring the objects it was given."""

    path: Path
    step: int
    trainer_state: dict[str, Any]  # as saved, including "step"
    meta: dict[str, Any]
    resharded_from: dict[str, Any] | None = None  # the saving run's {"world_size", "layout"} when it differs


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def read_meta(path: Path) -> dict[str, Any]:
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


def read_meta_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return read_meta(path)
    except CheckpointError:
        return None


def file_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``directory`` (relative names), for ``meta.json``."""
    return {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(directory.rglob("*")) if p.is_file()
    }


def verify_files(path: Path, manifest: dict[str, dict[str, Any]], closed_dirs: tuple[str, ...] = ()) -> None:
    """Every file of ``manifest`` ({relative path: {"bytes", "sha256"}}, as in meta.json) exists under
    ``path`` with its recorded size and sha256, and each of ``closed_dirs`` holds only listed files.
    Raises `CheckpointError` naming the first file that is missing, unlisted, or altered."""
    for name in manifest:
        pure = PurePath(name)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:  # meta.json is as untrusted as the rest
            raise CheckpointError(f"{path / META_FILE} lists {name!r}, a path outside the checkpoint")
    for directory in closed_dirs:
        for file in sorted((path / directory).rglob("*")):
            if file.is_file() and file.relative_to(path).as_posix() not in manifest:
                raise CheckpointError(f"{file} is not listed in {path / META_FILE}: refusing to load it")
    for name, expected in manifest.items():
        file = require_file(path, name)
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} is corrupt: {size} bytes, meta.json recorded {expected['bytes']}")
        if sha256_of(file) != expected["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from the one in meta.json")


def require_file(path: Path, name: str) -> Path:
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is missing {name}")
    return file


def scan_checkpoints(root: str | os.PathLike) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Complete checkpoints under ``root`` (a ``step_*`` directory with a valid meta.json of its step), oldest
    first, and the ``step_*`` directories that are not, each with the reason."""
    root = Path(root)
    if not root.is_dir():
        return [], []
    found, rejected = [], []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if not match or not path.is_dir():
            continue
        step = int(match.group(1))
        try:
            meta = read_meta(path)
        except CheckpointError as error:
            rejected.append((step, path, str(error)))
            continue
        if meta.get("step") != step:
            rejected.append((step, path, f"{path / META_FILE} says step {meta.get('step')!r}"))
        else:
            found.append((step, path))
    return [path for _, path in sorted(found)], [(path, why) for _, path, why in sorted(rejected)]


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``step_*`` directory with a valid meta.json), oldest first."""
    return scan_checkpoints(root)[0]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(
    resume: str | os.PathLike | None, root: str | os.PathLike, report: Callable[[str], None] | None = None
) -> Path | None:
    """Turn a ``resume`` setting into a checkpoint path.

    ``"auto"``: the latest complete checkpoint under ``root``, or None when there is none; a newer
    ``step_*`` directory that is not complete (unreadable meta.json) is passed over and ``report``ed
    (default: a logged warning). ``"never"``, ``""`` or None: None; anything else: that checkpoint
    directory (must be complete).
    """
    if resume is None or str(resume).strip() in ("", "never"):
        return None
    if str(resume).strip() == "auto":
        complete, rejected = scan_checkpoints(root)
        chosen = complete[-1] if complete else None
        report = report or _log.warning
        for path, why in rejected:
            if chosen is None or path.name > chosen.name:
                fallback = f"falling back to {chosen.name}" if chosen else "no older complete checkpoint: starting fresh"
                report(f"resume=auto passes over {path}: {why}; {fallback}")
        return chosen
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"resume checkpoint {str(path)!r} does not exist or is not a directory")
    read_meta(path)
    return path


def load_torch_state(file: Path) -> Any:
    """A ``.pt`` file of plain state, loaded with ``weights_only=True`` (no arbitrary unpickling)."""
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{file} cannot be loaded safely: {error}") from error
