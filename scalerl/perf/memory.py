"""Peak memory of this process: accelerator memory on a GPU, resident set size on a CPU."""

from __future__ import annotations

import resource
import sys

import torch


def max_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)
