"""How many intra-op threads torch should use, from the CPUs this process may run on and how busy the other
processes keep them, re-checked during a run.

Small kernels with more threads than free cores collapse: each op waits for its slowest thread, and a
thread that shares a core with another busy process is slow (measured on a 2-core machine: the demo's GRPO
step went from 0.81 s to 2.64 s at 2 threads beside one busy process, 1.33 s at 1 thread). So the thread
count follows the free cores: all of them on a quiet machine, fewer when other processes take some.

Other processes' load is read from the kernel's counters (`/proc/stat` minus this process's own CPU time
in `/proc/self/stat`) over the interval since the last check, so it needs no sampling thread and costs
microseconds. Where those files do not exist (not Linux), the thread count stays as torch chose it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@dataclass(frozen=True)
class CpuCounters:
    """Cumulative CPU seconds: all CPUs busy (`system_busy`), this process (`own`), at wall time `wall`."""

    system_busy: float
    own: float
    wall: float


def read_cpu_counters(proc: Path = Path("/proc")) -> CpuCounters | None:
    try:
        fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
        values = [int(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        busy = sum(values[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is in user)
        own_fields = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        own = int(own_fields[11]) + int(own_fields[12])  # utime, stime (fields 14 and 15 of the whole line)
    except (OSError, ValueError, IndexError):
        return None
    return CpuCounters(busy / _CLOCK_TICKS, own / _CLOCK_TICKS, time.monotonic())


def cores_used_by_others(before: CpuCounters, after: CpuCounters) -> float:
    """Average number of cores other processes kept busy between two readings."""
    elapsed = after.wall - before.wall
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((after.system_busy - before.system_busy) - (after.own - before.own)) / elapsed)


def threads_for(available: int, others: float) -> int:
    """Threads for the cores left free: a core counts as taken once others use half of it or more."""
    return max(1, min(available, available - int(others + 0.5)))


class ThreadGovernor:
    """Sets torch's intra-op thread count to the free cores, re-checked at most every ``interval_s``.

    ``max_threads`` (e.g. from ``OMP_NUM_THREADS`` or a config) caps it; ``enabled=False`` leaves torch
    alone. `update()` is called once per training step; it returns the count now in use.
    """

    def __init__(self, max_threads: int | None = None, interval_s: float = 5.0, enabled: bool = True,
                 proc: Path = Path("/proc")):
        self.available = min(available_cpus(), max_threads or torch.get_num_threads() or 1)
        self.interval_s, self.enabled, self.proc = interval_s, enabled, proc
        # With one CPU (or one thread allowed, as in spawned ranks) there is nothing to choose.
        self._last = read_cpu_counters(proc) if enabled and self.available > 1 else None
        self.others = 0.0
        if self._last is not None:
            time.sleep(0.25)  # a first look at the machine before the first step (the counters tick at 100 Hz)
            self.update(force=True)

    def update(self, force: bool = False) -> int:
        if not self.enabled or self._last is None:
            return torch.get_num_threads()
        now = read_cpu_counters(self.proc)
        if now is None or (not force and now.wall - self._last.wall < self.interval_s):
            return torch.get_num_threads()
        self.others = cores_used_by_others(self._last, now)
        self._last = now
        wanted = threads_for(self.available, self.others)
        if wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)
        return wanted


def cpu_thread_governor(cpu_threads: int, device: torch.device) -> ThreadGovernor:
    """``trainer.cpu_threads``: 0 follows the free cores (CPU runs only); N fixes N threads."""
    if device.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    return ThreadGovernor(enabled=device.type == "cpu" and not cpu_threads)
