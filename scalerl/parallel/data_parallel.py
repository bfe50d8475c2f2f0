"""Data parallelism: DDP (replicate, with the gradient-reduction comm hook) or FSDP2 (`fully_shard`; HSDP
on a 2-D mesh), and what of the `comm` config applies to each."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from scalerl.comm.counted_collectives import SendCallback
from scalerl.comm.gradient_reducer import CAST_DTYPES, GradientReducer, gradient_reduction_hook
from scalerl.comm.reduction_setup import build_gradient_reducer
from scalerl.models.decoder import decoder_layers


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True,
               reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard each decoder layer, then the root (embeddings, norm, head), over ``dp_mesh``.

    A 1-D mesh is FSDP; a 2-D ``(dp_replicate, dp_shard)`` mesh is HSDP (shard inside a group, replicate
    across groups). Per-layer units let the all-gather of layer i+1 overlap the compute of layer i.
    ``reduce_dtype`` makes the gradient reduce-scatter run in that dtype (comm.gradient_compression=bf16/fp16).
    """
    extra = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)} if reduce_dtype is not None else {}
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **extra)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **extra)
    return model


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


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, comm=None, device_type: str = "cpu", topology=None,
              on_send: SendCallback | None = None) -> tuple[DistributedDataParallel, GradientReducer | None]:
    """Replicate ``model`` over ``dp_mesh``; with a ``comm`` config section its gradients go through a
    `GradientReducer` hook (flat / hierarchical all-reduce, compression, byte counts; ``on_send(kind,
    nbytes, seconds)`` hears of every collective it runs). Returns both."""
    group = dp_mesh.get_group()
    reducer = build_gradient_reducer(comm, group, model, device_type, topology, on_send) if comm is not None else None
    ddp = DistributedDataParallel(model, process_group=group)
    if reducer is not None:
        ddp.register_comm_hook(reducer, gradient_reduction_hook)
    return ddp, reducer
