"""Files that are either complete or absent: durable writes, checksums, publish-by-rename and pruning.

Everything of a checkpoint is written into ``root/.tmp-step_00000012-<pid>/``, fsynced, and only then
renamed to its final name. A crash mid-save leaves at most a hidden temporary directory, which the next
save removes. One process writes to a checkpoint root at a time (rank 0 publishes distributed ones).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

TEMP_PREFIXES = (".tmp-", ".old-", ".del-")  # hidden names used only while saving or pruning


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


def fsync_dir(directory: Path) -> None:
    """Make renames and new entries in ``directory`` durable (a no-op where directories can't be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(temp: Path, final: Path) -> Path:
    """Rename the finished temporary directory to its final name, replacing an older copy."""
    old = None
    if final.exists():
        # A directory cannot be renamed over a non-empty one: move the old copy aside first. If we die
        # between the two renames, `remove_stale_temporaries` moves the old copy back.
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(temp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def prune(complete: list[Path], keep_last: int | None, just_written: Path) -> None:
    """Delete the oldest of ``complete`` (oldest first) so ``keep_last`` remain, ``just_written`` included."""
    if keep_last is None:
        return
    others = [p for p in complete if p != just_written]
    for path in others[: max(len(others) - (keep_last - 1), 0)]:
        # Rename first: a half-deleted directory must never still look like a checkpoint.
        doomed = path.with_name(f".del-{path.name}-{os.getpid()}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(root: Path, keep: Path, is_complete: Callable[[Path], bool]) -> None:
    """Delete what an interrupted save or prune left behind (one writer per root, so none is live)."""
    for path in root.iterdir():
        if path == keep or not path.name.startswith(TEMP_PREFIXES) or not path.is_dir():
            continue
        if path.name.startswith(".old-"):
            original = root / path.name[len(".old-") :].rsplit("-", 1)[0]
            if not original.exists() and is_complete(path):
                os.rename(path, original)  # died between "move old away" and "move new in"
                continue
        shutil.rmtree(path, ignore_errors=True)
