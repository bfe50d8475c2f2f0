"""The collectives gradient reduction uses, each counting the bytes this rank sends and the time it took.

Bytes come from the one formula, `scalerl.comm.counting.collective_bytes.wire_bytes`, for the group's
backend: on gloo a reduce-scatter sends as much as an all-reduce (2(n-1)/n x its input), which the
emulated network's link counters confirm (`tests/comm/test_link_bytes.py`). Every call reports to an
optional `on_send(kind, nbytes, seconds)` callback, so the per-rank `CommCounter` can be plugged in
(`scalerl.parallel.data_parallel.counting_callback`): `kind` is "<collective>:<scope>" ("all_reduce:inter",
"all_gather:flat", ...), `seconds` the call's wall time when it blocked on gloo, and None for async
calls and on NCCL, whose calls return before the transfer is done.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from scalerl.comm.counting.collective_bytes import wire_bytes

SendCallback = Callable[[str, int, Optional[float]], None]
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones. Looked up at
# each call, so a wrapper patched onto torch.distributed (the doctor's wait timing) sees the call.
def _all_gather_single(*args, **kwargs):
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


def _sent(op: str, payload: torch.Tensor, group, src: int = 0) -> int:
    """`wire_bytes` of ``op`` over ``group`` for ``payload`` (what S is for ``op``), rounded to bytes."""
    return round(wire_bytes(op, nbytes(payload), group.size(), dist.get_backend(group),
                            group_rank=dist.get_rank(group), root=src))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountedCollectives:
    """Blocking collectives on explicit groups that add up bytes sent and seconds per kind."""

    def __init__(self, on_send: SendCallback | None = None):
        self.on_send = on_send
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def _record(self, kind: str, sent: int, start: float | None, tensor: torch.Tensor) -> None:
        seconds = None if start is None or tensor.is_cuda else time.perf_counter() - start
        self.bytes_sent[kind] += sent
        if seconds is not None:
            self.seconds[kind] += seconds
        if self.on_send is not None:
            self.on_send(kind, sent, seconds)

    def _run(self, kind: str, sent: int, tensor: torch.Tensor, call, async_op: bool):
        """`call(async_op)`; a blocking call is timed, an async one returns its work handle untimed."""
        if async_op:
            work = call(True)
            self._record(kind, sent, None, tensor)
            return work
        start = time.perf_counter()
        call(False)
        self._record(kind, sent, start, tensor)
        return None

    def all_reduce(self, tensor: torch.Tensor, group, scope: str, async_op: bool = False):
        """In-place SUM over `group`; with async_op, returns the work handle."""
        sent = _sent("all_reduce", tensor, group)
        return self._run(f"all_reduce:{scope}", sent, tensor,
                         lambda a: dist.all_reduce(tensor, group=group, async_op=a), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group, scope: str, async_op: bool = False):
        """SUM of `tensor` (size = group size x output size) over `group`, this rank's chunk into `output`."""
        sent = _sent("reduce_scatter", tensor, group)
        return self._run(f"reduce_scatter:{scope}", sent, tensor,
                         lambda a: _reduce_scatter_single(output, tensor, group=group, async_op=a), async_op)

    def all_gather(self, output: torch.Tensor, chunk: torch.Tensor, group, scope: str, async_op: bool = False):
        """Every rank's `chunk` concatenated in group-rank order into `output`."""
        sent = _sent("all_gather", output, group)  # S: the gathered output
        return self._run(f"all_gather:{scope}", sent, chunk,
                         lambda a: _all_gather_single(output, chunk, group=group, async_op=a), async_op)

    def broadcast(self, tensor: torch.Tensor, group, scope: str):
        """`tensor` from the group's first rank to all its ranks."""
        src = dist.get_global_rank(group, 0)
        sent = _sent("broadcast", tensor, group, src=0)
        return self._run(f"broadcast:{scope}", sent, tensor,
                         lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a), False)

    def pop(self) -> tuple[dict[str, int], dict[str, float]]:
        """Bytes and seconds per kind since the last pop."""
        sent, seconds = dict(self.bytes_sent), dict(self.seconds)
        self.bytes_sent.clear()
        self.seconds.clear()
        return sent, seconds
