"""How the frameworks' own collectives record themselves into a `CommCounter`: DDP's all-reduce, FSDP2's
all-gathers and reduce-scatters, tensor parallelism's DTensor collectives. Bytes go through
`scalerl.comm.counting.collective_bytes.wire_bytes` (`CommCounter.record`), from the real buffers.

**DDP** (kind ``grad``): the default gradient all-reduce as a comm hook that counts each bucket. DDP calls
the hook once per gradient bucket, on the last backward before an optimizer step (``no_sync`` backwards
call none). The hook records the bucket's bytes, runs torch's own ``allreduce_hook`` (divide by the group
size, all-reduce, same numerics as no hook) and measures the iteration's exposed communication time
(`CommCounter.track_bucket`). Compression hooks record their own collectives the same way.

**FSDP2**, through the hooks torch exposes:
- all-gathers (forward unshard, and the backward re-gather when ``reshard_after_forward``, kind ``param``):
  a custom ``AllGather`` (`FSDPModule.set_custom_all_gather`) that records and times torch's default one;
- reduce-scatters (backward, every micro-batch, kind ``grad``): a custom ``ReduceScatter`` likewise;
- HSDP's all-reduce of the reduced shard over the replicate dimension: torch calls it directly, then the
  all-reduce hook (`FSDPModule.set_all_reduce_hook`) with its output; the hook records its size, and its
  time is the interval since the reduce-scatter returned (on gloo both are synchronous, so that interval is
  the all-reduce).
Each call counts the real buffers FSDP sends (padded shards, in the all-gather / reduce dtype). Units of
size 1 (a shard group of one rank) issue no all-gather or reduce-scatter, and none is counted. Needs
torch >= 2.8 for the custom-comm hooks; on older versions nothing is counted and `count_fsdp_collectives`
returns False.

**Tensor parallelism** (kind ``tp``, dimension ``tp``): DTensor issues TP's collectives inside its dispatch,
where no hook reaches; they follow from the plan's layouts and the activation shapes, which module hooks see:
- ``RowwiseParallel`` with a replicated output: forward all-reduce of the output (partial sums);
- ``PrepareModuleInput`` turning a plain input into a replicated DTensor (the attention and MLP blocks):
  backward all-reduce of the input's gradient, once per block: the column-wise projections inside take
  that DTensor and leave their partial gradients to add up first (2 per decoder layer, as Megatron);
- ``ColwiseParallel`` with a replicated input given as a plain tensor: backward all-reduce of the input's
  gradient (each rank holds a partial one);
- ``ColwiseParallel`` with a replicated output (the vocabulary-split head): forward all-gather of it.
Counted when they happen: forward ones in the forward hook (also during generation and activation
recomputation, which repeat them), backward ones from a gradient hook on the module's output, so a
forward without backward counts none. Their time is not measured (see
`scalerl.comm.counting.accounting.TIMED_KINDS`).
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation against the real type.

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

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


# ---- DDP ----------------------------------------------------------------------------------------------
@dataclass
class CountedAllReduceState:
    process_group: dist.ProcessGroup
    counter: CommCounter
    dim: str = "dp_replicate"  # the mesh dimension DDP replicates over


def counted_allreduce_hook(state: CountedAllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.counter.record("grad", "all_reduce", tensor_bytes(bucket.buffer()), state.process_group.size(),
                         dim=state.dim)
    return state.counter.track_bucket("grad", allreduce_hook(state.process_group, bucket), bucket.is_last())


@dataclass
class TimedReducerState:
    """A `GradientReducer` (hierarchical all-reduce, compression) whose iterations' exposed communication
    time is measured like the default hook's (its bytes it reports itself, through ``on_send``)."""

    reducer: Any
    counter: CommCounter


def timed_reduction_hook(state: TimedReducerState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.counter.track_bucket("grad", state.reducer.reduce(bucket), bucket.is_last())


# ---- FSDP2 --------------------------------------------------------------------------------------------
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

    def __init__(self, counter: CommCounter, group_size: int, dim: str, reduce_scatter: "CountedReduceScatter"):
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


# ---- tensor parallelism -------------------------------------------------------------------------------
def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def count_tensor_parallel_style(module: nn.Module, style: ParallelStyle, counter: CommCounter, tp_size: int,
                                dim: str = "tp") -> None:
    """Register the counting hooks for ``module`` laid out with ``style`` (after `parallelize_module`,
    so these hooks see its inputs and outputs as the style leaves them)."""
    if tp_size <= 1:
        return
    replicated = lambda layouts: all(isinstance(p, Replicate) for p in layouts)  # noqa: E731
    forward_op = None
    if isinstance(style, RowwiseParallel) and replicated(style.output_layouts):
        forward_op = "all_reduce"
    elif isinstance(style, ColwiseParallel) and replicated(style.output_layouts):
        forward_op = "all_gather"
    prepares_input = isinstance(style, PrepareModuleInput) and isinstance(style.input_layouts[0], Replicate)
    backward_input_all_reduce = prepares_input or (isinstance(style, ColwiseParallel)
                                                   and replicated(style.input_layouts))

    arrived_as_dtensor = [False]

    def before_style(mod, args):  # runs before the style's own input conversion (prepended)
        arrived_as_dtensor[0] = isinstance(_first_tensor(args), DTensor)

    def after_forward(mod, args, output):
        out, inp = _first_tensor(output), _first_tensor(args)
        if out is None:
            return
        if forward_op is not None:
            counter.record("tp", forward_op, tensor_bytes(out), tp_size, dim=dim)
        # A column-wise projection handed a DTensor (prepared by its block) reduces nothing itself.
        own_reduce = not arrived_as_dtensor[0]
        if backward_input_all_reduce and own_reduce and inp is not None and inp.requires_grad \
                and out.requires_grad and torch.is_grad_enabled():
            size = tensor_bytes(inp)

            def on_output_grad(grad):
                counter.record("tp", "all_reduce", size, tp_size, dim=dim)

            out.register_hook(on_output_grad)

    module.register_forward_pre_hook(before_style, prepend=True)
    module.register_forward_hook(after_forward)
