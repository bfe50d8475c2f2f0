"""Data parallelism: DDP (replicate, with comm hooks) or FSDP2 (`fully_shard`; HSDP on a 2-D mesh)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from scalerl.models.decoder import decoder_layers
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True) -> nn.Module:
    """Shard each decoder layer, then the root (embeddings, norm, head), over ``dp_mesh``.

    A 1-D mesh is FSDP; a 2-D ``(dp_replicate, dp_shard)`` mesh is HSDP (shard inside a group, replicate
    across groups). Per-layer units let the all-gather of layer i+1 overlap the compute of layer i.
    """
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, comm_hook: Callable | None = None, hook_state=None):
    """Replicate ``model`` over ``dp_mesh``; ``comm_hook`` (e.g. gradient compression) replaces the all-reduce."""
    ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group())
    if comm_hook is not None:
        ddp.register_comm_hook(hook_state, comm_hook)
    return ddp
