"""Gradient-norm clipping over a mix of plain tensors and DTensors (FSDP shards, TP shards)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scalerl.comm.counting.accounting import CommCounter


def total_grad_norm(grads: list[torch.Tensor], extra_group=None, counter: CommCounter | None = None) -> torch.Tensor:
    """L2 norm of the logical (unsharded) gradients, the same on every rank.

    Squares of local shards are summed per (mesh, sharded dims) and all-reduced once per such group over
    the dims they are sharded on; replicated dims are counted once. One collective per group, not per
    parameter; each a scalar, counted as ``metrics`` traffic in ``counter``.
    """
    counted = (counter if counter is not None else CommCounter()).collective  # a scratch one: counts dropped
    groups: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float32))
    meshes = {}
    for g in grads:
        if isinstance(g, DTensor):
            # Any non-replicated placement splits the tensor (Shard, and the _StridedShard FSDP uses over TP).
            sharded = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
            key = (id(g.device_mesh), sharded)
            meshes[key] = g.device_mesh
            local = g.to_local()
        else:
            key, local = (None, ()), g
        # vector_norm reduces without a full-size square (``pow(2)`` made one per gradient: 8.3 MiB, the
        # largest TP shard, held on by glibc through the update on the 0.5B-shaped plan cell)
        square = torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()
        groups[key] = groups[key].to(local.device) + square
    total = None
    for (mesh_id, sharded), value in groups.items():
        for dim in sharded:
            group = meshes[(mesh_id, sharded)].get_group(dim)
            with counted("metrics", "all_reduce", value, group):
                dist.all_reduce(value, group=group)
        total = value if total is None else total + value.to(total.device)
    if total is None:
        total = torch.zeros(())
    if extra_group is not None:  # e.g. the pipeline group: each rank holds different parameters
        with counted("metrics", "all_reduce", total, extra_group, dim="pp"):
            dist.all_reduce(total, group=extra_group)
    return total.sqrt()


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Read at clipping time, not before the forward: FSDP2 swaps a root module's registered parameters
    between sharded DTensors and unsharded tensors around forward/backward, and gradients land on the
    sharded ones."""
    return [p for p in module.parameters() if p.requires_grad]


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    max_norm: float,
    norm_params: list[torch.nn.Parameter] | None = None,
    extra_group=None,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most ``max_norm`` (``<= 0``: measure only).
    The norm is taken over ``norm_params`` (default ``params``; a pipeline leaves out a tied copy) and
    summed over ``extra_group``. Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm_grads = grads if norm_params is None else [p.grad for p in norm_params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if extra_group is None and not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    total = total_grad_norm(norm_grads, extra_group, counter)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(float(scale))
    return total
