"""Counting FSDP2's collectives through the hooks torch exposes for them.

- all-gathers (forward unshard, and the backward re-gather when ``reshard_after_forward``): a custom
  ``AllGather`` (`FSDPModule.set_custom_all_gather`) that records and times torch's default one;
- reduce-scatters (backward, every micro-batch): a custom ``ReduceScatter`` likewise;
- HSDP's all-reduce of the reduced shard over the replicate dimension: torch calls it directly, then the
  all-reduce hook (`FSDPModule.set_all_reduce_hook`) with its output; the hook records its size, and its
  time is the interval since the reduce-scatter returned (on gloo both are synchronous, so that interval is
  the all-reduce).

Each call counts the real buffers FSDP sends (padded shards, in the all-gather / reduce dtype). Units of
size 1 (a shard group of one rank) issue no all-gather or reduce-scatter, and none is counted. Needs
torch >= 2.8 for the custom-comm hooks; on older versions nothing is counted and `count_fsdp_collectives`
returns False.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from scalerl.comm.counting.accounting import CommCounter, tensor_bytes

try:  # private module paths, public API (set_custom_all_gather / set_custom_reduce_scatter) since torch 2.8
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )
except ImportError:  # pragma: no cover - older torch
    AllGather = ReduceScatter = None


if AllGather is not None:

    class CountedAllGather(AllGather):
        """torch's default FSDP all-gather, counted as kind ``param``."""

        def __init__(self, counter: CommCounter, dim: str):
            self.inner, self.counter, self.dim = DefaultAllGather(), counter, dim

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            self.counter.record("param", "all_gather", tensor_bytes(output_tensor), group.size(), dim=self.dim)
            start = time.perf_counter()
            work = self.inner(output_tensor, input_tensor, group, async_op)
            if not async_op:  # an async one is waited on inside FSDP, out of our sight
                self.counter.add_wait("param", time.perf_counter() - start)
            return work

    class CountedReduceScatter(ReduceScatter):
        """torch's default FSDP reduce-scatter, counted as kind ``grad``."""

        def __init__(self, counter: CommCounter, dim: str):
            self.inner, self.counter, self.dim = DefaultReduceScatter(), counter, dim
            self.returned_at = 0.0  # when the last reduce-scatter returned (HSDP's all-reduce follows)

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            self.counter.record("grad", "reduce_scatter", tensor_bytes(input_tensor), group.size(), dim=self.dim)
            start = time.perf_counter()
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            self.returned_at = time.perf_counter()
            if not async_op:
                self.counter.add_wait("grad", self.returned_at - start)
            return work


class _HSDPAllReduceCount:
    """FSDP's all-reduce hook: counts the all-reduce over the replicate dimension that just finished."""

    def __init__(self, counter: CommCounter, group_size: int, dim: str, reduce_scatter: CountedReduceScatter):
        self.counter, self.group_size, self.dim, self.reduce_scatter = counter, group_size, dim, reduce_scatter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.counter.record("grad", "all_reduce", tensor_bytes(reduce_output), self.group_size, dim=self.dim)
        if self.reduce_scatter.returned_at:
            self.counter.add_wait("grad", time.perf_counter() - self.reduce_scatter.returned_at)
            self.reduce_scatter.returned_at = 0.0


def count_fsdp_collectives(model: nn.Module, counter: CommCounter, shard_dim: str,
                           replicate_dim: str | None = None, replicate_size: int = 1) -> bool:
    """Count the collectives of every FSDP unit in ``model`` (after `fully_shard`). ``replicate_dim`` /
    ``replicate_size``: HSDP's replicate dimension. Returns False when this torch lacks the hooks."""
    if AllGather is None:
        return False
    if replicate_dim is not None:
        counter.declare("grad", shard_dim)
        counter.declare("grad", replicate_dim)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        reduce_scatter = CountedReduceScatter(counter, shard_dim)
        module.set_custom_all_gather(CountedAllGather(counter, shard_dim))
        module.set_custom_reduce_scatter(reduce_scatter)
        if replicate_dim is not None:
            module.set_all_reduce_hook(_HSDPAllReduceCount(counter, replicate_size, replicate_dim, reduce_scatter))
    return True
