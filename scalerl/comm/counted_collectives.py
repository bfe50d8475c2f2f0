"""The collectives gradient reduction uses, each counting the bytes this rank sends and the time it took.

Bytes are what this rank puts on the wire under the ring algorithms gloo and NCCL use for large tensors
(nccl-tests' accounting): all-reduce 2(n-1)/n x size, reduce-scatter (n-1)/n x input size, all-gather
(n-1) x this rank's chunk, broadcast size (root) / 0. Every call reports to an optional
`on_send(kind, nbytes, seconds)` callback, so a per-rank byte counter (`scalerl.comm.accounting` on
another branch) can be plugged in: `kind` is "<collective>:<scope>" ("all_reduce:inter",
"all_gather:flat", ...), `seconds` the call's wall time on gloo, and None on NCCL, whose calls return
before the transfer is done.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

SendCallback = Callable[[str, int, Optional[float]], None]
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def ring_wire_bytes(collective: str, payload_bytes: int, group_size: int, is_root: bool = False) -> int:
    """Bytes one rank sends for `collective` over a ring of `group_size` ranks; `payload_bytes` is the
    tensor this rank hands in (all_gather: its own chunk; reduce_scatter: the full input)."""
    n = group_size
    if n <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (n - 1) * payload_bytes // n
    if collective == "reduce_scatter":
        return (n - 1) * payload_bytes // n
    if collective == "all_gather":
        return (n - 1) * payload_bytes
    if collective == "broadcast":
        return payload_bytes if is_root else 0
    raise ValueError(f"unknown collective {collective!r}")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountedCollectives:
    """Blocking collectives on explicit groups that add up bytes sent and seconds per kind."""

    def __init__(self, on_send: SendCallback | None = None):
        self.on_send = on_send
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def _record(self, kind: str, sent: int, start: float, tensor: torch.Tensor) -> None:
        seconds = None if tensor.is_cuda else time.perf_counter() - start
        self.bytes_sent[kind] += sent
        if seconds is not None:
            self.seconds[kind] += seconds
        if self.on_send is not None:
            self.on_send(kind, sent, seconds)

    def all_reduce(self, tensor: torch.Tensor, group, scope: str) -> torch.Tensor:
        """In-place SUM over `group`."""
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        self._record(f"all_reduce:{scope}", ring_wire_bytes("all_reduce", nbytes(tensor), group.size()), start, tensor)
        return tensor

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group, scope: str) -> torch.Tensor:
        """SUM of `tensor` (size = group size x output size) over `group`, this rank's chunk into `output`."""
        start = time.perf_counter()
        _reduce_scatter_single(output, tensor, group=group)
        self._record(f"reduce_scatter:{scope}", ring_wire_bytes("reduce_scatter", nbytes(tensor), group.size()),
                     start, tensor)
        return output

    def all_gather(self, output: torch.Tensor, chunk: torch.Tensor, group, scope: str) -> torch.Tensor:
        """Every rank's `chunk` concatenated in group-rank order into `output`."""
        start = time.perf_counter()
        _all_gather_single(output, chunk, group=group)
        self._record(f"all_gather:{scope}", ring_wire_bytes("all_gather", nbytes(chunk), group.size()), start, chunk)
        return output

    def broadcast(self, tensor: torch.Tensor, group, scope: str) -> torch.Tensor:
        """`tensor` from the group's first rank to all its ranks."""
        start = time.perf_counter()
        src = dist.get_global_rank(group, 0)
        dist.broadcast(tensor, src=src, group=group)
        is_root = dist.get_rank() == src
        self._record(f"broadcast:{scope}", ring_wire_bytes("broadcast", nbytes(tensor), group.size(), is_root),
                     start, tensor)
        return tensor

    def pop(self) -> tuple[dict[str, int], dict[str, float]]:
        """Bytes and seconds per kind since the last pop."""
        sent, seconds = dict(self.bytes_sent), dict(self.seconds)
        self.bytes_sent.clear()
        self.seconds.clear()
        return sent, seconds
