"""What both trainers need around the math: seeding, mixed-precision contexts, step timers, memory readings."""

from __future__ import annotations

import contextlib
import random
import resource
import sys
import time
from collections import defaultdict

import numpy as np
import torch

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_context(precision: str, device: torch.device):
    """A fresh autocast context for bf16/fp16 compute (parameters stay fp32), or None for fp32."""
    if precision == "fp32":
        return None
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


class AutocastFactory:
    """Autocast contexts are single-use; this hands out a new one each time it is entered."""

    def __init__(self, precision: str, device: torch.device):
        self.precision, self.device = precision, device

    def __enter__(self):
        self._ctx = autocast_context(self.precision, self.device) or contextlib.nullcontext()
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class StepTimer:
    """``with timer("gen"):`` accumulates wall seconds under ``timing_s/gen``; CUDA work is synchronised at
    the section's end so the time lands in the right section (one sync per section, not per kernel)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[f"timing_s/{name}"] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        times, self.times = dict(self.times), defaultdict(float)
        return times


def max_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)
