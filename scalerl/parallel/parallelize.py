"""The one place parallelism is applied: pipeline stages -> tensor parallel -> expert parallel (MoE) ->
sequence parallel (Ulysses) -> activation checkpointing -> data parallel (DDP / FSDP2 / HSDP).

`parallelize` returns the model's parts for this rank (torchtitan's ``model_parts`` idea): the full model
that generates and computes log-probs, and what trains. Trainers use the parts through one interface
(forward + backward of micro-batches, gradient clipping, metrics of the loss, refreshing the generation
copy), so they never ask which layout is running:

- `ModuleParts`: one module generates and trains (single process, DDP, FSDP2, HSDP, TP and their mixes);
- `PipelineParts`: this rank trains its pipeline stages and generates with a full replica that is
  refreshed from the stages after the update.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scalerl.comm.counting.accounting import CommCounter
from scalerl.comm.gradients.reducer import GradientReducer
from scalerl.models.moe import RouterAuxLoss
from scalerl.models.transformers_model import layout_refusal
from scalerl.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    set_activation_checkpointing,
)
from scalerl.parallel.data_parallel import apply_ddp, apply_fsdp, fsdp_reduce_dtype
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.expert_parallel import (
    apply_expert_parallel,
    expert_parallel_grad_norm,
    is_expert_parameter,
    shard_experts,
)
from scalerl.parallel.grad_norm import clip_grad_norm, trainable_parameters
from scalerl.parallel.mesh import LayoutError
from scalerl.parallel.pipeline import PipelineRunner
from scalerl.parallel.sequence_parallel import apply_sequence_parallel, gradient_mesh
from scalerl.parallel.tensor_parallel import apply_tensor_parallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class MicroBatch:
    """One forward's inputs: ``output = model(input_ids, attention_mask, logits_to_keep=keep)`` and the
    per-token ``target`` the loss reads (aligned to the last positions of the sequence)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target: torch.Tensor
    keep: int = 0  # trailing positions the loss needs outputs for; 0 = all


@dataclass
class PipelineOptions:
    schedule: str = "1f1b"
    microbatches: int = 4


class ModuleParts:
    """One module that generates and trains: ``model`` (sharded or TP-split in place) and the module the
    training forward calls (a DDP wrapper for plain replication, else ``model`` itself)."""

    fixed_shapes = False  # any batch shape may go through `forward_backward`

    def __init__(self, model: nn.Module, trained: nn.Module, comm: CommCounter | None = None,
                 gradient_reducer: GradientReducer | None = None, expert_parallel: DistContext | None = None):
        self.model, self.trained, self.comm = model, trained, comm
        self.expert_parallel = expert_parallel  # the context experts are sharded over (parallel.ep > 1)
        self.gradient_reducer = gradient_reducer  # DDP's comm hook state: byte counts, compression plan
        self.router_aux = RouterAuxLoss.of(model)  # MoE: load-balancing loss and load metrics; None if dense
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())  # FSDP2 or tensor parallel

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def state_module(self) -> nn.Module:
        """The module whose state a checkpoint holds on this rank."""
        return self.model

    def train(self) -> None:
        self.model.train()
        set_activation_checkpointing(self.model, True)

    def eval(self) -> None:
        self.model.eval()
        set_activation_checkpointing(self.model, False)

    def forward_backward(self, micros: Sequence[MicroBatch], loss_fn: LossFn, autocast=None, grad_scaler=None) -> int:
        """Accumulate the gradients of ``sum(loss_fn(output, target))`` over ``micros``; returns the number of
        loss calls. DDP all-reduces only on the last backward; FSDP reduce-scatters on every one."""
        # Plain (unsharded) weights are cast to the compute dtype once for all micro-batches, not once each;
        # FSDP2/TP parameters are gathered per forward, and a cast held across gathers would be stale.
        holds = autocast is not None and not self.sharded
        with autocast.holding_casts() if holds else contextlib.nullcontext():
            for i, micro in enumerate(micros):
                no_sync = getattr(self.trained, "no_sync", None) if i < len(micros) - 1 else None
                # DDP decides in its forward whether the backward all-reduces: the forward belongs inside no_sync.
                with no_sync() if no_sync else contextlib.nullcontext():
                    with autocast or contextlib.nullcontext():
                        output = self.trained(micro.input_ids, attention_mask=micro.attention_mask,
                                              logits_to_keep=micro.keep)
                    with autocast.paused() if holds else contextlib.nullcontext():  # fp32 loss and backward
                        loss = loss_fn(output, micro.target)
                        if self.router_aux is not None:
                            mask = micro.attention_mask if isinstance(micro.attention_mask, torch.Tensor) else None
                            loss = loss + self.router_aux.loss_term(mask, len(micros))  # packed rows: no padding
                        (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        return len(micros)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.expert_parallel is not None:  # each rank holds different experts: their norms add up
            experts = [p for n, p in self.model.named_parameters() if is_expert_parameter(n)]
            return expert_parallel_grad_norm(trainable_parameters(self.model), experts, max_norm, self.expert_parallel)
        return clip_grad_norm(trainable_parameters(self.model), max_norm, counter=self.comm)

    def share_loss_metrics(self, values: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, float]:
        """The loss's metrics as floats on every rank (here they are computed on every rank already)."""
        return {k: float(values[k]) for k in names if k in values}

    def refresh_generation_copy(self) -> int:
        """The model generates with the trained parameters themselves: nothing to copy."""
        return 0



class PipelineParts:
    """This rank's pipeline stages (trained) and a full replica of the model (generates, log-probs)."""

    fixed_shapes = True  # pipeline stages fix activation shapes at their first step
    gradient_reducer = None  # stages are laid out with FSDP2, which reduces gradients itself

    def __init__(self, replica: nn.Module, runner: PipelineRunner, ctx: DistContext):
        self.model, self.runner, self.ctx = replica, runner, ctx

    def parameters(self) -> list[nn.Parameter]:
        return self.runner.parameters()

    def state_module(self) -> nn.Module:
        return nn.ModuleDict({f"stage{s}": m for s, m in zip(self.runner.stage_ids, self.runner.modules)})

    def train(self) -> None:
        self.runner.train()

    def eval(self) -> None:
        self.model.eval()

    def forward_backward(self, micros: Sequence[MicroBatch], loss_fn: LossFn, autocast=None, grad_scaler=None) -> int:
        """One schedule step over the concatenated micro-batches (the schedule splits them into
        ``parallel.microbatches`` itself); the tied embedding's gradient copies are summed afterwards."""
        input_ids = torch.cat([m.input_ids for m in micros])
        attention_mask = torch.cat([m.attention_mask for m in micros])
        target = torch.cat([m.target for m in micros])

        def scaled_loss(output: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(output, tgt)
            return grad_scaler.scale(loss) if grad_scaler is not None else loss

        self.runner.step(input_ids, attention_mask, target, scaled_loss)
        self.runner.sync_tied_gradients()
        return self.runner.microbatches

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        r = self.runner
        return clip_grad_norm(r.parameters(), max_norm, r.norm_parameters(), r.pp_group, counter=self.ctx.comm)

    def share_loss_metrics(self, values: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, float]:
        """Loss metrics live on the last stage; every pipeline rank gets them (rank 0 logs)."""
        r = self.runner
        t = torch.tensor([float(values[k]) if k in values else float("nan") for k in names],
                         dtype=torch.float64, device=self.ctx.device)
        last_owner = dist.get_process_group_ranks(r.pp_group)[r.owner[r.num_stages - 1]]
        with self.ctx.comm.collective("metrics", "broadcast", t, r.pp_group, dim="pp", src=last_owner):
            dist.broadcast(t, src=last_owner, group=r.pp_group)
        return {k: v for k, v in zip(names, t.tolist()) if v == v}

    def refresh_generation_copy(self) -> int:
        """Copy the stages' weights into the full replica on every pipeline rank; returns bytes received."""
        return self.runner.refresh_replica()



ModelParts = ModuleParts | PipelineParts


def parallelize(
    model: nn.Module,
    ctx: DistContext,
    *,
    activation_checkpointing: bool = False,
    trainable: bool = True,
    pipeline: PipelineOptions | None = None,
    autocast=None,
    comm=None,
    on_send=None,
    param_dtype: torch.dtype | None = None,
) -> ModelParts:
    """Lay ``model`` out over ``ctx``'s mesh (in place) and return its parts for this rank.

    Plain replication (dp only) uses DDP, whose comm hooks carry gradient compression; any layout with
    sharding or tensor parallelism uses FSDP2 on the ``(dp_replicate, dp_shard)`` mesh, which composes with
    DTensor TP (DDP does not support DTensor parameters). With ``parallel.pp > 1`` the trained stages are
    cut from the model first; the model itself becomes the replica (tensor-parallel like the stages).
    ``trainable=False`` (a frozen reference model) skips gradient machinery and pipeline stages.
    ``comm`` (the config's CommSection) picks DDP's gradient all-reduce (flat / hierarchical) and
    compression; under FSDP2 only fp16/bf16 apply, as the reduce dtype (`fsdp_reduce_dtype`).
    Gradient collectives are counted in ``ctx.comm`` (and reported to ``on_send(kind, nbytes, seconds)``
    when given); the cluster view gathered at start (``ctx.cluster``) saves gathering the topology again.
    ``param_dtype`` (trainer.fsdp_param_dtype) is FSDP2's compute dtype over float32 master weights.
    """
    mesh, dims = ctx.mesh, ctx.dims
    if mesh is None or dims.world_size == 1:
        if activation_checkpointing and trainable:
            apply_activation_checkpointing(model)
        return ModuleParts(model, model)
    if (refusal := layout_refusal(model, dims)) is not None:  # the transformers fallback: DDP / FSDP2 only
        raise LayoutError(refusal)
    dims.check_model(model.config)
    if dims.pp > 1 and trainable:
        options = pipeline or PipelineOptions()

        def layout_stage(stage: nn.Module) -> None:
            _apply_layout(stage, ctx, activation_checkpointing, use_ddp=False, comm=comm, param_dtype=param_dtype)

        # Stages are cut from the unsharded model, before it becomes the replica.
        runner = PipelineRunner(model, ctx, options.schedule, options.microbatches, layout_stage, autocast)
        if dims.tp > 1:
            apply_tensor_parallel(model, mesh["tp"], ctx.comm)
        return PipelineParts(model, runner, ctx)
    if dims.pp > 1:  # a frozen replica for forward passes only
        if dims.tp > 1:
            apply_tensor_parallel(model, mesh["tp"], ctx.comm)
        return ModuleParts(model, model, ctx.comm)
    trained, reducer = _apply_layout(model, ctx, activation_checkpointing and trainable, use_ddp=trainable,
                                     comm=comm if trainable else None, on_send=on_send, param_dtype=param_dtype)
    return ModuleParts(model, trained, ctx.comm, reducer, ctx if dims.ep > 1 and trainable else None)


def _apply_layout(module: nn.Module, ctx: DistContext, activation_checkpointing: bool, use_ddp: bool,
                  comm=None, on_send=None, param_dtype: torch.dtype | None = None
                  ) -> tuple[nn.Module, GradientReducer | None]:
    """TP -> activation checkpointing -> DP on a whole model or one pipeline stage; returns the module the
    training forward calls and DDP's gradient reducer (None without DDP). Without gradients to
    synchronise (``use_ddp=False`` under plain replication) plain replicas suffice."""
    dims, mesh = ctx.dims, ctx.mesh
    if dims.tp > 1:
        apply_tensor_parallel(getattr(module, "backbone", module), mesh["tp"], ctx.comm)  # a value model's backbone
    if dims.ep > 1 and use_ddp:  # a frozen reference keeps every expert: its forwards need no all-to-all
        apply_expert_parallel(module, ctx, sharded=dims.dp_shard > 1)
    if dims.sp > 1:  # every forward of this model, frozen or trained, splits its sequences
        apply_sequence_parallel(module, ctx)
    if activation_checkpointing:
        apply_activation_checkpointing(module)
    if dims.dp * dims.sp > 1:
        if dims.dp_shard == 1 and dims.tp == 1 and dims.pp == 1:
            if not use_ddp:
                return module, None
            dp_mesh = ctx.dp_mesh if dims.sp == 1 else gradient_mesh(ctx, shard=False)  # sp ranks' grads sum too
            return apply_ddp(module, dp_mesh, comm, ctx.device.type, getattr(ctx, "cluster", None), ctx.comm,
                             on_send)
        if dims.ep > 1 and use_ddp:  # the experts first: FSDP2 over their replicas (ep and sp are exclusive)
            shard_experts(module, param_dtype, fsdp_reduce_dtype(comm))
        fsdp_mesh = ctx.fsdp_mesh if dims.sp == 1 else gradient_mesh(ctx, shard=True)
        apply_fsdp(module, fsdp_mesh, counter=ctx.comm, reduce_dtype=fsdp_reduce_dtype(comm), param_dtype=param_dtype)
    return module, None

