"""Data parallelism: DDP (replicate, with comm hooks) or FSDP2 (`fully_shard`; HSDP on a 2-D mesh).

With a ``counter`` (`scalerl.comm.accounting.CommCounter`), the collectives are counted: DDP's default
all-reduce runs as a counting comm hook, FSDP's through counting all-gather / reduce-scatter objects.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from scalerl.comm.accounting import CommCounter
from scalerl.comm.ddp_counting import CountedAllReduceState, counted_allreduce_hook
from scalerl.comm.fsdp_counting import count_fsdp_collectives
from scalerl.models.decoder import decoder_layers
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True,
               counter: CommCounter | None = None) -> nn.Module:
    """Shard each decoder layer, then the root (embeddings, norm, head), over ``dp_mesh``.

    A 1-D mesh is FSDP; a 2-D ``(dp_replicate, dp_shard)`` mesh is HSDP (shard inside a group, replicate
    across groups). Per-layer units let the all-gather of layer i+1 overlap the compute of layer i.
    """
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if counter is not None:
        names = dp_mesh.mesh_dim_names or ("dp_shard",)
        hsdp = dp_mesh.ndim == 2
        count_fsdp_collectives(model, counter, shard_dim=names[-1], replicate_dim=names[0] if hsdp else None,
                               replicate_size=dp_mesh.size(0) if hsdp else 1)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, comm_hook: Callable | None = None, hook_state=None,
              counter: CommCounter | None = None):
    """Replicate ``model`` over ``dp_mesh``; ``comm_hook`` (e.g. gradient compression) replaces the
    all-reduce (and records its own traffic in ``counter``); without one, a ``counter`` gets torch's
    default all-reduce as a counting hook."""
    ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group())
    if comm_hook is not None:
        ddp.register_comm_hook(hook_state, comm_hook)
    elif counter is not None:
        ddp.register_comm_hook(CountedAllReduceState(dp_mesh.get_group(), counter), counted_allreduce_hook)
    return ddp
