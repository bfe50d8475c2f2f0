"""One permission policy for everything a run writes: the process umask decides, as for any file.

Files get ``0o666 & ~umask``, directories ``0o777 & ~umask`` (0644 / 0755 under the common umask 022;
0600 / 0700 under 077). Libraries that pick their own modes are brought back to it: safetensors creates
weights 0600 and ``tempfile.mkdtemp`` makes 0700 directories, which left a model private next to a
world-readable optimizer state and config. Why the umask and not a fixed private mode: see
docs/reliability.md ("File permissions").
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:  # os.umask can only be read by setting it: set it back at once
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    return 0o777 & ~current_umask()


def apply_file_modes(path: Path) -> None:
    """Give ``path`` and, for a directory, everything under it the policy's modes."""
    path = Path(path)
    files, dirs = file_mode(), dir_mode()
    if not path.is_dir():
        os.chmod(path, files)
        return
    os.chmod(path, dirs)
    for root, dirnames, filenames in os.walk(path):
        for name in dirnames:
            os.chmod(os.path.join(root, name), dirs)
        for name in filenames:
            os.chmod(os.path.join(root, name), files)
