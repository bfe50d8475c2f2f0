"""Wall time per phase of a training step."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


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
