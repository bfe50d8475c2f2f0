"""The one mini-batch update loop, shared by the actor, the critic and SFT on every layout:

    for each epoch: for each shuffled mini-batch:
        counts over DP ranks -> zero grads -> forward + backward of its micro-batches -> optimizer step

`OptimizerStep` is one optimizer step: unscale (fp16 loss scaling), clip the gradient norm, skip the step
when the norm is not finite (counted), step, update the loss scale. How micro-batches run (plain modules
with gradient accumulation, or a pipeline schedule) is the model parts' business (`scalerl.parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scalerl.models.packing import packed_batch_or_none
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.parallelize import MicroBatch, ModelParts
from scalerl.parallel.seqlen_balance import (
    packed_micro_batches,
    sequence_lengths,
    token_budget_micro_batches,
)
from scalerl.rollout.batch import RolloutBatch
from scalerl.trainer.objectives import MicroBatchObjective


@dataclass(frozen=True)
class UpdatePlan:
    """How a batch is cut: ``epochs`` passes, mini-batches of ``mini_batch_size`` rows (this rank's share)
    per optimizer step, micro-batches of ``micro_batch_size`` rows or up to ``micro_batch_max_tokens``."""

    epochs: int
    mini_batch_size: int
    micro_batch_size: int
    micro_batch_max_tokens: int = 0
    horizon: int | None = None  # seq-mean-token-sum-norm's constant (the response length limit)
    shuffle: bool = True
    # Pipeline stages see one shape every step: (prompt width, response width) to pad mini-batches to.
    fixed_widths: tuple[int, int] | None = None
    # actor.use_remove_padding: micro-batches packed into rows of real tokens, attention by this kernel
    # (`scalerl.models.packing`); the budget then counts real tokens. None = padded rows.
    packed_kernel: str | None = None


class OptimizerStep:
    """Unscale -> clip -> step unless the gradient norm is not finite -> update the loss scale.

    `consecutive_skips` counts the optimizer steps skipped in a row (over every `run_update` that uses this
    step), so the trainer can stop a run whose weights no longer change."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_scaler: torch.amp.GradScaler | None, max_norm: float):
        self.optimizer, self.grad_scaler, self.max_norm = optimizer, grad_scaler, max_norm
        self.consecutive_skips = 0

    def count_skips(self, skipped: list[float]) -> None:
        """Fold this update's per-step skip flags (in order) into the run of consecutive skips."""
        for flag in skipped:
            self.consecutive_skips = self.consecutive_skips + 1 if flag else 0

    def __call__(self, parts: ModelParts) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the gradient norm before clipping and 1.0 if the step was skipped (as tensors: no sync)."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        norm = parts.clip_grad_norm(self.max_norm)
        finite = torch.isfinite(norm)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)  # skips the step itself on inf/nan gradients
            self.grad_scaler.update()
        elif finite:
            self.optimizer.step()
        return norm.detach(), (~finite).float()


def mini_batch_counts(mini: RolloutBatch, ctx: DistContext, horizon: int | None) -> dict[str, Any]:
    """`aggregate_loss`'s keyword arguments for one mini-batch: its valid tokens and sequences summed over
    the data-parallel ranks (one all-reduce), the DP size gradients are averaged over, and the horizon."""
    counts = ctx.all_reduce(torch.stack([mini.response_mask.sum(), (mini.response_mask.sum(-1) > 0).sum().float()]))
    return dict(global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=ctx.dp_size, horizon=horizon)


def micro_batches(batch: RolloutBatch, size: int) -> list[RolloutBatch]:
    device = batch.input_ids.device
    return [batch.select(torch.arange(start, min(start + size, len(batch)), device=device))
            for start in range(0, len(batch), size)]


def token_budget_batches(batch: RolloutBatch, max_tokens: int, ctx: DistContext, packed: bool = False
                         ) -> list[RolloutBatch]:
    """Dynamic batch size: micro-batches packed up to ``max_tokens`` padded tokens (real tokens when
    ``packed``, `packed_micro_batches`: a longer sequence is an error). Ranks agree on the count (the largest
    any rank needs), since sharded/TP forwards must run in lockstep."""
    lengths = sequence_lengths(batch.attention_mask).tolist()  # real tokens: what rebalancing across ranks counts too

    def pack(count: int | None = None) -> list[list[int]]:
        if packed:
            return packed_micro_batches(lengths, max_tokens, same_count_across=count)
        return token_budget_micro_batches(lengths, max_tokens, same_count_across=count)

    groups = pack()
    if ctx.world_size > 1:
        count = ctx.all_reduce(torch.tensor([len(groups)], device=ctx.device), op="max", over="trainer")
        groups = pack(int(count))
    device = batch.input_ids.device
    return [batch.select(torch.tensor(sorted(g), device=device)) for g in groups]


def _forward_inputs(parts: ModelParts, mini: RolloutBatch, plan: UpdatePlan, objective, ctx) -> list[MicroBatch]:
    packed = None if parts.fixed_shapes else plan.packed_kernel  # pipeline stages fix padded shapes
    if parts.fixed_shapes:  # the pipeline splits the padded mini-batch into its own micro-batches
        micros = [mini.padded_to(*plan.fixed_widths)]
    elif plan.micro_batch_max_tokens:
        micros = token_budget_batches(mini, plan.micro_batch_max_tokens, ctx, packed=packed is not None)
    else:
        micros = micro_batches(mini, plan.micro_batch_size)
    if not parts.fixed_shapes:  # columns that are padding in every row cost compute and change nothing
        micros = [m.trimmed()[0] for m in micros]
    # Packed, the model reads one row of real tokens and hands back only the predictions of the masked
    # response tokens, [1, M, ...]: the loss's log-softmax runs on those M tokens (`objectives`).
    # Under sequence parallelism the shards keep the padded layout (`SequenceShards`).
    objective.packed_outputs = packed is not None and ctx.dims.sp == 1
    return [MicroBatch(*packed_batch_or_none(m.input_ids, m.attention_mask, packed,
                                             m.response_mask > 0 if objective.packed_outputs else None),
                       objective.target(m), objective.keep(m)) for m in micros]


def run_update(
    parts: ModelParts,
    step: OptimizerStep,
    batch: RolloutBatch,
    objective: MicroBatchObjective,
    plan: UpdatePlan,
    generator: torch.Generator | None,
    ctx: DistContext,
    autocast=None,
) -> dict[str, float]:
    """``plan.epochs`` x mini-batches x micro-batches of ``objective`` on ``batch`` (this rank's rows).

    Returns the objective's metrics (averaged over mini-batches), ``<prefix>/grad_norm`` (mean over
    optimizer steps) and ``<prefix>/skipped_steps`` (optimizer steps skipped for a non-finite norm)."""
    n = len(batch)
    norms, skipped = [], []
    parts.train()
    for _ in range(plan.epochs):
        if plan.shuffle:
            order = torch.randperm(n, generator=generator).to(batch.input_ids.device)
        else:
            order = torch.arange(n, device=batch.input_ids.device)
        for start in range(0, n, plan.mini_batch_size):
            mini = batch.select(order[start : start + plan.mini_batch_size])
            objective.start_mini_batch(mini_batch_counts(mini, ctx, plan.horizon))
            step.optimizer.zero_grad(set_to_none=True)
            micros = _forward_inputs(parts, mini, plan, objective, ctx)
            calls = parts.forward_backward(micros, objective, autocast, step.grad_scaler)
            objective.end_mini_batch(calls)
            norm, was_skipped = step(parts)
            norms.append(norm)
            skipped.append(was_skipped)
    metrics = parts.share_loss_metrics(objective.summary(), objective.metric_names)
    prefix = objective.metric_names[0].split("/")[0]
    metrics[f"{prefix}/grad_norm"] = float(torch.stack(norms).float().mean())
    flags = torch.stack(skipped).tolist()
    step.count_skips(flags)
    metrics[f"{prefix}/skipped_steps"] = float(sum(flags))
    router_aux = getattr(parts, "router_aux", None)
    if router_aux is not None:  # MoE: moe/aux_loss and moe/expert_load_imbalance over the step's DP ranks
        moe = router_aux.metrics(ctx.all_reduce)
        metrics.update({f"critic/{k}" if prefix == "critic" else k: v for k, v in moe.items()})
    return metrics
