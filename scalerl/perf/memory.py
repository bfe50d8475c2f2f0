"""Peak memory of this process (accelerator memory on a GPU, resident set size on a CPU), and what the
device holds in all."""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import sys

import torch


def proc_field_gib(path: str | os.PathLike, key: str) -> float | None:
    """A ``key: N kB`` line of a /proc file (``/proc/self/status``, ``/proc/meminfo``) in GiB; None where the file
    is not there (not Linux), lacks the line or has it malformed."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024**2
    except (OSError, ValueError, IndexError):
        return None
    return None


def max_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak resident set size on the CPU: its own high-water
    mark (VmHWM) on Linux, since it started or since the doctor's phase profiler last reset it. Not
    ``ru_maxrss``: Linux carries the parent's resident set at the fork into it across exec, so a run started by a
    large process (a test session, a launcher) read that process's peak as its own."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    peak = proc_field_gib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)


def memory_capacity_gb(device: torch.device) -> float:
    """The device's memory in GiB: the GPU's total, or the host's RAM (MemTotal) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1024**3
    total = proc_field_gib("/proc/meminfo", "MemTotal")
    if total is not None:
        return total
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' ctypes takes no None
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_host_memory(device: torch.device) -> bool:
    """Give the memory a phase freed back to the operating system, at the switches between generation and
    training (the trainer calls it when generation is over and when the update is: the CPU's counterpart of
    emptying a GPU's cache there). On the CPU torch allocates with glibc's malloc, which keeps freed blocks
    resident in its heap: after an update on the 0.5B-shaped plan cell the trainer held 0.13-0.17 GiB of freed
    gradients and activations (RSS 0.81 GiB of anonymous memory against 0.68 once trimmed), which stayed
    through generation and the next step; under FSDP over 2 ranks generation left 0.11 GiB of gathered weights
    resident through the update. ``malloc_trim(0)`` returns every free page (12-25 ms on that cell, under 1.5%
    of a step; microseconds on a small heap). Not on a GPU: the built-in engine in the same process reuses the
    caching allocator's blocks, and emptying it would only make the next update allocate them again. True when
    memory was trimmed."""
    trim = _malloc_trim() if device.type == "cpu" else None
    if trim is None:
        return False
    trim(0)
    return True
