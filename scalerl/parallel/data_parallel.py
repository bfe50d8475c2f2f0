"""Data parallelism: DDP (replicate, with a gradient-reduction comm hook) or FSDP2 (`fully_shard`; HSDP on
a 2-D mesh), and what of the `comm` config applies to each.

With a ``counter`` (`scalerl.comm.counting.accounting.CommCounter`) the collectives are counted: DDP's plain
all-reduce runs as torch's default hook wrapped to count, a `GradientReducer` (hierarchical or compressed)
reports each collective it runs, FSDP's go through counting all-gather / reduce-scatter objects.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from scalerl.comm.counting.accounting import CommCounter
from scalerl.comm.counting.counted_collectives import SendCallback
from scalerl.comm.counting.framework_collectives import (
    CountedAllReduceState,
    TimedReducerState,
    count_fsdp_collectives,
    counted_allreduce_hook,
    timed_reduction_hook,
)
from scalerl.comm.gradients.reducer import (
    CAST_DTYPES,
    GradientReducer,
    gradient_reduction_hook,
)
from scalerl.comm.gradients.setup import build_gradient_reducer
from scalerl.models.decoder import decoder_layers


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True,
               counter: CommCounter | None = None, reduce_dtype: torch.dtype | None = None,
               param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard each decoder layer, then the root (embeddings, norm, head), over ``dp_mesh``.

    A 1-D mesh is FSDP; a 2-D ``(dp_replicate, dp_shard)`` mesh is HSDP (shard inside a group, replicate
    across groups). Per-layer units let the all-gather of layer i+1 overlap the compute of layer i.
    ``reduce_dtype`` makes the gradient reduce-scatter run in that dtype (comm.gradient_compression=bf16/fp16).
    ``param_dtype`` (`mixed_precision_policies`) gathers and computes in that dtype over fp32 shards.
    """
    extra, root_extra = mixed_precision_policies(param_dtype, reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **extra)
    # The root (embedding, final norm, head) is the last unit a forward leaves and the first its backward
    # needs: kept gathered in between (torch's default for a root), it is not all-gathered again for the
    # backward. Its unsharded weights live from forward to backward (or to the next forward after a
    # no-grad pass, which sees the same weights: the optimizer steps only after a backward, whose end
    # reshards it).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **root_extra)
    if counter is not None:
        names = dp_mesh.mesh_dim_names or ("dp_shard",)
        hsdp = dp_mesh.ndim == 2
        count_fsdp_collectives(model, counter, shard_dim=names[-1], replicate_dim=names[0] if hsdp else None,
                               replicate_size=dp_mesh.size(0) if hsdp else 1)
    return model


def mixed_precision_policies(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
                             ) -> tuple[dict, dict]:
    """``fully_shard``'s extra arguments for the decoder layers and for the root. With a low-precision
    ``param_dtype``, as large runs train: the sharded (master) parameters stay float32, each unit is
    gathered and computed in ``param_dtype``, gradients are reduced in float32 (or ``reduce_dtype``) and
    the root's outputs (the logits the losses read) come back as float32."""
    if param_dtype in (None, torch.float32):
        policy = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)} if reduce_dtype is not None else {}
        return policy, policy
    reduce_dtype = reduce_dtype or torch.float32
    layers = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32)
    return {"mp_policy": layers}, {"mp_policy": root}


def fsdp_reduce_dtype(comm) -> torch.dtype | None:
    """What of ``comm`` applies under FSDP2, said once at start: fp16/bf16 become the reduce dtype;
    PowerSGD / top-k cannot (the config check refuses them for sharded layouts, this guards direct
    callers); comm.allreduce is DDP's (HSDP with dp_shard = ranks per node is FSDP's hierarchy)."""
    if comm is None:
        return None
    if comm.gradient_compression in ("powersgd", "topk"):
        raise ValueError(f"comm.gradient_compression={comm.gradient_compression} needs DDP (plain data "
                         "parallelism); FSDP2 reduce-scatters shards without comm hooks. Use bf16 / fp16 "
                         "(FSDP's reduce dtype) or none")
    if comm.allreduce == "hierarchical":
        warnings.warn("comm.allreduce=hierarchical applies to DDP only; under FSDP2 gradients are reduce-"
                      "scattered by FSDP itself (for a node hierarchy use HSDP: parallel.dp_shard = ranks per "
                      "node, parallel.dp_replicate = nodes)", stacklevel=3)
    return CAST_DTYPES.get(comm.gradient_compression)


def counting_callback(counter: CommCounter | None, also: SendCallback | None = None) -> SendCallback | None:
    """A `GradientReducer`'s ``on_send(kind, nbytes, seconds)`` written into ``counter`` as gradient bytes
    (``kind`` is ``"<collective>:<scope>"``, e.g. ``all_reduce:inter``; the bytes are already on-wire),
    and passed on to ``also``."""
    if counter is None:
        return also

    def on_send(kind: str, nbytes: int, seconds: float | None) -> None:
        op, _, scope = kind.partition(":")
        counter.add_sent("grad", op, nbytes, dim=scope or None)
        if seconds is not None:
            counter.add_wait("grad", seconds)
        if also is not None:
            also(kind, nbytes, seconds)

    return on_send


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, comm=None, device_type: str = "cpu", topology=None,
              counter: CommCounter | None = None, on_send: SendCallback | None = None,
              ) -> tuple[DistributedDataParallel, GradientReducer | None]:
    """Replicate ``model`` over ``dp_mesh``. With a ``comm`` config section, gradients go through a
    `GradientReducer` hook (flat or hierarchical all-reduce, compression; returned too) that reports each
    collective to ``counter`` and ``on_send``; without one, torch's default all-reduce, counted."""
    group = dp_mesh.get_group()
    reducer = None
    if comm is not None:
        reducer = build_gradient_reducer(comm, group, model, device_type, topology, counting_callback(counter, on_send))
    ddp = DistributedDataParallel(model, process_group=group)
    if reducer is not None and counter is not None:
        ddp.register_comm_hook(TimedReducerState(reducer, counter), timed_reduction_hook)
    elif reducer is not None:
        ddp.register_comm_hook(reducer, gradient_reduction_hook)
    elif counter is not None:
        ddp.register_comm_hook(CountedAllReduceState(group, counter), counted_allreduce_hook)
    return ddp, reducer
