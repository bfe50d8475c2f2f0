"""The one place parallelism is applied: tensor parallel -> activation checkpointing -> data parallel."""

from __future__ import annotations

from torch import nn

from scalerl.parallel.data_parallel import apply_ddp, apply_fsdp
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: nn.Module, ctx: DistContext, activation_checkpointing: bool = False, trainable: bool = True
) -> nn.Module:
    """Apply the layout to ``model`` in place and return the module the trainer should call for updates
    (a DDP wrapper for plain replication, otherwise ``model`` itself).

    Plain replication (dp only) uses DDP, whose comm hooks carry gradient compression; any layout with
    sharding or tensor parallelism uses FSDP2 on the ``(dp_replicate, dp_shard)`` mesh, which composes with
    DTensor TP (DDP does not support DTensor parameters).
    """
    model.gradient_checkpointing = activation_checkpointing
    mesh, dims = ctx.mesh, ctx.dims
    if mesh is None or dims.world_size == 1:
        return model
    dims.check_model(model.config)
    if dims.pp > 1:
        # `model` becomes the full replica for rollouts (tensor-parallel like the stages); the trained
        # stages are cut from it by `PipelineRunner` and laid out by `shard_pipeline_stage`.
        if dims.tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        return model
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if dims.dp > 1:
        if dims.dp_shard == 1 and dims.tp == 1 and dims.pp == 1:
            # A frozen model (the KL reference) has no gradients to synchronise: plain replicas suffice.
            return apply_ddp(model, ctx.dp_mesh) if trainable else model
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"])
    return model


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and TP modify the model in place, so it is the model)."""
    return getattr(module, "module", module)


def shard_pipeline_stage(stage: nn.Module, ctx: DistContext) -> None:
    """Lay out one pipeline stage over the non-pipeline dimensions: TP, or FSDP2/HSDP over dp."""
    dims, mesh = ctx.dims, ctx.mesh
    if dims.tp > 1:
        apply_tensor_parallel(stage, mesh["tp"])
    if dims.dp > 1:
        apply_fsdp(stage, mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"])
