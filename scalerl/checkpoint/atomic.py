"""Files that are either complete or absent: durable writes, checksums, publish-by-rename and pruning.

Everything of a checkpoint is written into ``root/.tmp-step_00000012-<pid>/``, fsynced, given the run's
file modes (`scalerl.core.file_modes`), and only then renamed to its final name
(`scalerl.core.directory_swap`). A crash mid-save leaves at most a hidden temporary directory, which the
next start (or save) removes. One process writes to a checkpoint root at a time (rank 0 publishes
distributed ones).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scalerl.core.directory_swap import (
    TEMP_PREFIXES,
    fsync_dir,
    recover_leftovers,
    remove_directory,
    replace_directory,
)
from scalerl.core.file_modes import apply_file_modes

__all__ = [
    "TEMP_PREFIXES", "fsync_dir", "fsync_file", "prune", "publish", "remove_stale_temporaries",
    "save_torch_state", "sha256_of", "write_durably",
]


def write_durably(file: Path, data: bytes) -> None:
    with open(file, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def save_torch_state(obj: Any, file: Path) -> None:
    """``torch.save`` of plain state (tensors, numbers, dicts), fsynced; loaded back with weights_only=True."""
    with open(file, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_file(file: Path) -> None:
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(temp: Path, final: Path) -> Path:
    """Give the finished temporary directory the run's file modes and rename it to its final name,
    replacing an older copy."""
    apply_file_modes(temp)
    return replace_directory(temp, final)


def prune(complete: list[Path], keep_last: int | None, just_written: Path) -> None:
    """Delete the oldest of ``complete`` (oldest first) so ``keep_last`` remain, ``just_written`` included."""
    if keep_last is None:
        return
    others = [p for p in complete if p != just_written]
    for path in others[: max(len(others) - (keep_last - 1), 0)]:
        remove_directory(path)


def remove_stale_temporaries(root: Path, keep: Path | None, is_complete: Callable[[Path], bool]) -> list[str]:
    """Put right what an interrupted save or prune left behind (one writer per root, so none is live);
    returns what was done."""
    return recover_leftovers(root, is_complete, keep=keep)
