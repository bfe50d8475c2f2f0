"""The trainer's step timer, instrumented for `--performance-profiling`: per phase its wall time, the time
spent waiting for peers and in collectives (`CollectiveWaits`), and its peak memory; each phase ends at a
barrier, so a rank slow in one phase is charged there and not in the next collective of another phase.
Each top-level phase also records the memory held when it starts (``start_gb``): at a switch between
training and generation, what the previous phase left behind, apart from what the phase adds itself."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from scalerl.doctor.collective_waits import CollectiveWaits
from scalerl.doctor.host_memory import host_peak_gb, host_rss_gb, reset_host_peak
from scalerl.perf.timing import StepTimer


@dataclass
class PhaseStats:
    time_s: float = 0.0
    peer_s: float = 0.0
    comm_s: float = 0.0
    peak_gb: float = 0.0
    start_gb: float = 0.0  # the most memory held when a top-level run of the phase started

    @property
    def busy_s(self) -> float:
        return max(0.0, self.time_s - self.peer_s - self.comm_s)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    reset_host_peak()  # VmHWM back to the current resident set; refused: the lifetime peak, an over-estimate


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gb()


def current_memory_gb(device: torch.device) -> float:
    """Memory held now: the allocator's on a GPU, the resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return host_rss_gb()


class PhaseProfiler(StepTimer):
    """Drop-in for the trainer's `StepTimer` (a trainer's ``timer=`` argument). Sections may nest
    (the optimizer step inside an update): a phase's time excludes its nested phases', and only top-level
    phases end at a barrier (nested ones run a different number of times per rank under some layouts)."""

    def __init__(self, device: torch.device, waits: CollectiveWaits, distributed: bool):
        super().__init__(device)
        self.waits = waits
        self.distributed = distributed
        self.phases: dict[str, PhaseStats] = defaultdict(PhaseStats)
        self._nested_time: list[float] = []  # per open section: time spent in sections nested in it

    @contextlib.contextmanager
    def __call__(self, name: str):
        outer, self.waits.phase = self.waits.phase, name
        top_level = not self._nested_time
        self._nested_time.append(0.0)
        held = None
        probe_start = time.perf_counter()
        if top_level:
            reset_peak_memory(self.device)
            held = current_memory_gb(self.device)
        start = time.perf_counter()
        probe_s = start - probe_start
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.distributed and top_level:
                self.waits.barrier()
            elapsed = time.perf_counter() - start
            nested = self._nested_time.pop()
            if self._nested_time:
                self._nested_time[-1] += elapsed
            self.times[f"timing_s/{name}"] += elapsed  # what the trainer reports: inclusive
            stats = self.phases[name]
            stats.time_s += elapsed - nested
            stats.peak_gb = max(stats.peak_gb, peak_memory_gb(self.device))
            if held is not None:
                stats.start_gb = max(stats.start_gb, held)
            self.waits.phase = outer
            if top_level:  # the memory probes' own time, outside every phase: the MFU waterfall takes it out
                self.times["timing_s/profiler_probes"] += probe_s + time.perf_counter() - start - elapsed

    def take_step(self) -> dict[str, PhaseStats]:
        """This step's phases with their waits folded in; starts the next step afresh."""
        phases, self.phases = dict(self.phases), defaultdict(PhaseStats)
        for name, totals in self.waits.reset().items():
            stats = phases.setdefault(name, PhaseStats())
            stats.peer_s += totals.peer_s
            stats.comm_s += totals.comm_s
        return phases


class TimedOptimizerStep:
    """The trainer's `OptimizerStep`, its calls timed as the ``optimizer`` phase (nested in the update), so
    the profile splits forward + backward from the optimizer."""

    def __init__(self, step, timer: PhaseProfiler):
        self._step, self._timer = step, timer

    def __getattr__(self, name: str):
        return getattr(self._step, name)  # optimizer, grad_scaler, max_norm: run_update reads them

    def __call__(self, parts):
        with self._timer("optimizer"):
            return self._step(parts)
