"""Bytes each rank puts on the wire per step, by kind of traffic and mesh dimension, and time spent waiting.

Every collective scalerl issues records itself here (`CommCounter.record`, or the `collective` context
manager that also times a synchronous call), its bytes through the one formula,
`scalerl.comm.counting.collective_bytes.wire_bytes` (the table of what S is per collective lives there).

One counter per process (`process_counter()`, also ``DistContext.comm``); the trainer takes
``pop()`` once per step. The metric keys are the same on every rank and every step (a rank that sent
nothing of a kind reports 0), because metric reduction gathers one vector of values per rank.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from scalerl.comm.counting.collective_bytes import wire_bytes

# rollout: prompts to standalone rollout workers and their outputs shared among the trainer's ranks;
# expert: expert parallelism's token all-to-alls (scalerl.parallel.expert_parallel); sequence: Ulysses' q/k/v
# and output all-to-alls and the hidden states' all-gather (scalerl.parallel.sequence_parallel)
KINDS = ("grad", "param", "tp", "pp", "rebalance", "weight_sync", "rollout", "metrics", "expert", "sequence")
# Kinds whose waiting time can be measured (synchronous calls, FSDP's collectives on gloo, DDP's exposed
# all-reduce). TP's all-reduces happen inside DTensor dispatch and pipeline sends/receives are waited on
# inside torch's schedules: their bytes are counted, their time is not.
TIMED_KINDS = ("grad", "param", "rebalance", "weight_sync", "rollout", "metrics", "expert", "sequence")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def sharded_over(t) -> int:
    """Ranks a DTensor is split over: the product of its non-replicated mesh dimensions. Gathering it
    whole (``full_tensor()``, dimension after dimension) sends (n-1)/n x its full size per rank, the same
    as one all-gather over all n."""
    size = 1
    for dim, placement in enumerate(getattr(t, "placements", ())):
        if not placement.is_replicate():
            size *= t.device_mesh.size(dim)
    return size


@dataclass
class Transfer:
    """The payload of one counted collective, in bytes (S of `wire_bytes`)."""

    payload_bytes: int | None = None


class CommCounter:
    """Per-rank bytes sent and seconds waited, by kind (``KINDS``) and mesh dimension, since the last
    ``pop()``/``reset()``. Thread-safe: DDP's completion callbacks run on the backend's threads."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self._lock = threading.Lock()
        self._declared: set[tuple[str, str]] = set()
        self.reset()

    # ---- recording -------------------------------------------------------------------------------------
    def record(self, kind: str, op: str, payload_bytes: float, group_size: int, *, dim: str | None = None,
               group_rank: int = 0, root: int = 0) -> float:
        """Count one collective of ``payload_bytes`` (S, see the table) over ``group_size`` ranks; returns
        the bytes this rank sends. ``dim`` names the mesh dimension (e.g. ``dp_shard``) it ran over."""
        if kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; one of {', '.join(KINDS)}")
        sent = wire_bytes(op, payload_bytes, group_size, self.backend, group_rank, root)
        with self._lock:
            self._bytes[(kind, op, dim)] += sent
            self._calls[(kind, op, dim)] += 1
        return sent

    def add_sent(self, kind: str, op: str, nbytes: float, *, dim: str | None = None) -> None:
        """Count bytes this rank sent, already computed for the algorithm that ran (e.g. by a comm hook)."""
        if kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; one of {', '.join(KINDS)}")
        with self._lock:
            self._bytes[(kind, op, dim)] += nbytes
            self._calls[(kind, op, dim)] += 1

    def add_wait(self, kind: str, seconds: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; one of {', '.join(KINDS)}")
        with self._lock:
            self._wait[kind] += max(0.0, seconds)

    @contextmanager
    def collective(self, kind: str, op: str, tensor: torch.Tensor | int | None, group=None, *,
                   dim: str | None = None, src: int | None = None) -> Iterator[Transfer]:
        """Count a collective over ``group`` (None: the default group) and time the synchronous call inside
        the ``with`` block. ``tensor`` is the payload (S) or its size in bytes; None when only the block
        knows it (a message of several parts): set ``.payload_bytes`` of what it yields. ``src`` is a
        broadcast's global source rank. On NCCL a synchronous call returns once queued: the time is then
        launch time."""
        transfer = Transfer(tensor if isinstance(tensor, (int, type(None))) else tensor_bytes(tensor))
        start = time.perf_counter()
        try:
            yield transfer
        finally:
            self.add_wait(kind, time.perf_counter() - start)
        if transfer.payload_bytes is None:
            raise ValueError(f"{kind} {op}: the payload's size was not given (set .payload_bytes in the block)")
        n = dist.get_world_size(group)
        root = dist.get_group_rank(group, src) if src is not None and group is not None else (src or 0)
        self.record(kind, op, transfer.payload_bytes, n, dim=dim, group_rank=dist.get_rank(group), root=root)

    def waited(self, kind: str, work) -> None:
        """``work.wait()``, timed: the part of an asynchronous collective this rank spent blocked on."""
        start = time.perf_counter()
        work.wait()
        self.add_wait(kind, time.perf_counter() - start)

    def track_bucket(self, kind: str, fut: torch.futures.Future, is_last: bool) -> torch.futures.Future:
        """For DDP comm hooks: returns ``fut`` chained with a callback that measures the *exposed* time of
        an iteration's gradient communication, from the moment the last bucket is issued (the backward's
        compute is then done) until every bucket of the iteration has completed. That is what the
        backward waits for in DDP's finalisation, which is not observable directly."""
        with self._lock:
            self._pending[kind] += 1
            if is_last:
                self._last_issue[kind] = time.perf_counter()

        def done(f: torch.futures.Future):
            with self._lock:
                self._pending[kind] -= 1
                if self._pending[kind] == 0 and kind in self._last_issue:
                    self._wait[kind] += max(0.0, time.perf_counter() - self._last_issue.pop(kind))
            return f.value()

        return fut.then(done)

    def declare(self, kind: str, dim: str) -> None:
        """Report ``comm/bytes/<kind>/<dim>`` every step (0 when nothing was sent). Call it the same way on
        every rank (at layout time), so every rank reports the same keys."""
        if kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; one of {', '.join(KINDS)}")
        self._declared.add((kind, dim))

    # ---- reading ---------------------------------------------------------------------------------------
    def bytes_by(self, kind: str | None = None, op: str | None = None, dim: str | None = None) -> float:
        """Bytes sent so far matching the given kind / op / dim (None: any)."""
        with self._lock:
            return sum(v for (k, o, d), v in self._bytes.items()
                       if (kind is None or k == kind) and (op is None or o == op) and (dim is None or d == dim))

    def waited_s(self) -> float:
        """Seconds blocked in timed collectives since the last reset (the step timer reads it per phase)."""
        with self._lock:
            return sum(self._wait.values())

    def calls(self) -> dict[tuple[str, str, str | None], int]:
        with self._lock:
            return dict(self._calls)

    def breakdown(self) -> dict[tuple[str, str, str | None], float]:
        """Bytes by (kind, op, dim) so far."""
        with self._lock:
            return dict(self._bytes)

    def step_metrics(self) -> dict[str, float]:
        """``comm/bytes/<kind>`` for every kind, ``comm/bytes/<kind>/<dim>`` for declared pairs,
        ``comm/bytes/total``, and ``timing_s/comm/<kind>`` for the kinds whose time is measured."""
        with self._lock:
            by_kind, by_kind_dim = defaultdict(float), defaultdict(float)
            for (k, _, d), v in self._bytes.items():
                by_kind[k] += v
                by_kind_dim[(k, d)] += v
            out = {f"comm/bytes/{k}": by_kind[k] for k in KINDS}
            out.update({f"comm/bytes/{k}/{d}": by_kind_dim[(k, d)] for k, d in sorted(self._declared)})
            out["comm/bytes/total"] = sum(by_kind.values())
            out.update({f"timing_s/comm/{k}": self._wait[k] for k in TIMED_KINDS})
        return out

    def reset(self) -> None:
        with self._lock:
            self._bytes: dict[tuple[str, str, str | None], float] = defaultdict(float)
            self._calls: dict[tuple[str, str, str | None], int] = defaultdict(int)
            self._wait: dict[str, float] = defaultdict(float)
            self._pending: dict[str, int] = defaultdict(int)
            self._last_issue: dict[str, float] = {}

    def pop(self) -> dict[str, float]:
        """``step_metrics()``, then ``reset()``: what the trainer calls once per step."""
        out = self.step_metrics()
        self.reset()
        return out


_PROCESS_COUNTER = CommCounter()


def process_counter() -> CommCounter:
    """This process's counter (the one ``DistContext.comm`` holds)."""
    return _PROCESS_COUNTER
