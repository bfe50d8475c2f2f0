"""Directories that are either complete or absent: stage, swap in, delete, and recover after a crash.

Checkpoints and exported models are written into a hidden sibling (``.tmp-<name>-<pid>``) and only then
renamed to their final name. A directory cannot be renamed over a non-empty one, so replacing an existing
one takes two renames: the old copy moves aside (``.old-<name>-<pid>``), the new one moves in, the old copy
is deleted. Deleting renames first (``.del-<name>-<pid>``), so a half-deleted directory never keeps a name
that says it is complete. Whatever a kill leaves behind is put right by `recover_leftovers` at the next
start: an old copy whose replacement never arrived is moved back, everything else is removed.

One writer per parent directory is assumed (one run per output directory; rank 0 publishes).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_PREFIXES = (".tmp-", ".old-", ".del-")  # hidden names used only while staging, replacing or deleting


def fsync_dir(directory: Path) -> None:
    """Make renames and new entries in ``directory`` durable (a no-op where directories can't be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(final: Path) -> Path:
    """A fresh, empty hidden sibling of ``final`` to build its new contents in (a stale one is removed)."""
    staged = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    return staged


def replace_directory(staged: Path, final: Path) -> Path:
    """Rename the finished ``staged`` directory to ``final``, replacing an older ``final`` as a whole: no file
    of the old copy survives (a stale shard or index cannot mix with the new one)."""
    old = None
    if final.exists():
        # If we die between the two renames, `recover_leftovers` moves the old copy back.
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(staged, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextmanager
def built_aside(final: Path) -> Iterator[Path]:
    """The staging directory of ``final`` to build in; swapped in for ``final`` when the block ends, removed
    if it raises (so an interrupted write leaves the old ``final`` as it was)."""
    staged = staging_dir(final)
    try:
        yield staged
        replace_directory(staged, final)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def remove_directory(path: Path) -> None:
    """Delete ``path``: renamed first, so a half-deleted directory never still looks complete."""
    doomed = path.with_name(f".del-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def original_name(leftover: str) -> str | None:
    """``step_00000004`` for ``.old-step_00000004-123``; None for names this module did not make."""
    for prefix in TEMP_PREFIXES:
        if leftover.startswith(prefix):
            stem, sep, _pid = leftover[len(prefix):].rpartition("-")
            return stem if sep and stem else None
    return None


def recover_leftovers(
    parent: Path,
    is_complete: Callable[[Path], bool],
    names: Callable[[str], bool] = lambda name: True,
    keep: Path | None = None,
) -> list[str]:
    """Put right what interrupted stagings, replacements and deletions left in ``parent``; returns what was
    done, one phrase per leftover. Only leftovers of directories whose original name passes ``names`` are
    touched; ``keep`` (a staging directory in use) is left alone. No writer may be live in ``parent``."""
    done = []
    if not parent.is_dir():
        return done
    for path in sorted(parent.iterdir()):
        name = original_name(path.name)
        if path == keep or name is None or not names(name) or not path.is_dir():
            continue
        original = parent / name
        if path.name.startswith(".old-") and not original.exists() and is_complete(path):
            os.rename(path, original)  # died between "move old away" and "move new in"
            done.append(f"restored {name} from {path.name}")
            continue
        shutil.rmtree(path, ignore_errors=True)
        done.append(f"removed {path.name}")
    return done
