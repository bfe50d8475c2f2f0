"""Time blocked in collectives, split into waiting for peers and the collective itself, per phase.

While active, every Python-level ``torch.distributed`` collective (what scalerl's own code calls: metric
reduction, generation's stop vote, rebalancing, gradient-norm and pipeline exchanges) is preceded by a
barrier on the same group. The barrier's time is this rank waiting for its slowest peer; the collective's
time after it is communication proper. Asynchronous calls and point-to-point ones are timed without a
barrier. Collectives issued inside torch (DDP's gradient buckets, FSDP2, DTensor) are not seen here; comm
accounting's ``timing_s/comm/*`` covers those where present. Used by ``--performance-profiling`` only: the
barriers cost a little time, which is the price of the attribution.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "all_gather_single", "reduce_scatter_single")  # the last two: torch 2.13's names
TIMED_ONLY = ("barrier", "send", "recv", "batch_isend_irecv")


@dataclass
class WaitTotals:
    peer_s: float = 0.0  # blocked until the slowest peer arrived
    comm_s: float = 0.0  # in the collective once everyone was there
    calls: int = 0


class CollectiveWaits:
    """Context manager patching ``torch.distributed``'s collectives; ``phase`` names where time lands."""

    def __init__(self):
        self.phase = "other"
        self.totals: dict[str, WaitTotals] = defaultdict(WaitTotals)
        self._originals: dict[str, Callable[..., Any]] = {}
        self._inside = threading.local()
        self._lock = threading.Lock()

    def reset(self) -> dict[str, WaitTotals]:
        with self._lock:
            totals, self.totals = dict(self.totals), defaultdict(WaitTotals)
        return totals

    def barrier(self) -> None:
        """A barrier over the default group, its time counted as waiting for peers in the current phase."""
        start = time.perf_counter()
        self._originals.get("barrier", dist.barrier)()
        with self._lock:
            self.totals[self.phase].peer_s += time.perf_counter() - start

    def __enter__(self) -> CollectiveWaits:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self._originals["barrier"] = dist.barrier
        for name in COLLECTIVES + TIMED_ONLY:
            if not hasattr(dist, name):  # a name this torch does not have (older or newer than the list)
                continue
            original = self._originals.get(name) or getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        barrier = self._originals["barrier"]
        separate = name in COLLECTIVES

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):  # a collective calling another: count the outer one
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._inside.active = True
            try:
                peer = 0.0
                if separate and not bound.get("async_op", False):
                    start = time.perf_counter()
                    barrier(group=bound.get("group"))
                    peer = time.perf_counter() - start
                start = time.perf_counter()
                result = original(*args, **kwargs)
                comm = time.perf_counter() - start
            finally:
                self._inside.active = False
            with self._lock:
                totals = self.totals[self.phase]
                totals.peer_s += peer
                totals.comm_s += comm
                totals.calls += 1
            return result

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        return timed
