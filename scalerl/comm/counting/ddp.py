"""DDP's default gradient all-reduce as a comm hook that counts each bucket (kind ``grad``).

DDP calls the hook once per gradient bucket, on the last backward before an optimizer step (``no_sync``
backwards call none). The hook records the bucket's bytes, runs torch's own ``allreduce_hook`` (divide by
the group size, all-reduce, same numerics as no hook) and measures the iteration's exposed communication
time (`CommCounter.track_bucket`). Compression hooks record their own collectives the same way.
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation against the real type.

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from scalerl.comm.counting.accounting import CommCounter, tensor_bytes


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
