"""Wall time per phase of a training step, and a rank's own share of it."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable

import torch


class StepTimer:
    """``with timer("gen"):`` accumulates wall seconds under ``timing_s/gen``; CUDA work is synchronised at
    the section's end so the time lands in the right section (one sync per section, not per kernel).
    With ``waited`` (comm accounting's seconds blocked in collectives so far), also the part of each section
    spent blocked in collectives, ``timing_s/comm_in/<name>`` (the MFU waterfall places waits by it)."""

    def __init__(self, device: torch.device, waited: Callable[[], float] | None = None):
        self.device = device
        self.waited = waited
        self.times: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        waited = self.waited() if self.waited is not None else 0.0
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[f"timing_s/{name}"] += time.perf_counter() - start
            if self.waited is not None:  # a reset inside the section (none in a step) would read negative
                self.times[f"timing_s/comm_in/{name}"] += max(0.0, self.waited() - waited)

    def pop(self) -> dict[str, float]:
        times, self.times = dict(self.times), defaultdict(float)
        return times


def busy_time(metrics: dict[str, float]) -> dict[str, float]:
    """``timing_s/busy``: this rank's step time minus its time blocked in collectives (``timing_s/comm/<kind>``,
    from comm accounting), i.e. its own work. A slow rank works longest; the ranks waiting for it spend that
    wait in collectives, so their step times alone look alike. Empty when no wait times are measured."""
    waits = [v for k, v in metrics.items() if k.startswith("timing_s/comm/") and k.count("/") == 2]
    if not waits or "timing_s/step" not in metrics:
        return {}
    return {"timing_s/busy": max(0.0, metrics["timing_s/step"] - sum(waits))}
