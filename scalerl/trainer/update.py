"""The one mini-batch update loop, shared by the actor, the critic and SFT on every layout:

    for each epoch: for each mini-batch (shuffled rows unless actor.shuffle=false):
        counts over DP ranks -> zero grads -> forward + backward of its micro-batches -> optimizer step

`UpdateRun` is that loop in pieces, so a streaming trainer can take the first epoch's mini-batches as
their rows arrive.

`OptimizerStep` is one optimizer step: unscale (fp16 loss scaling), clip the gradient norm, skip the step
when the norm is not finite (counted), step, update the loss scale. How micro-batches run (plain modules
with gradient accumulation, or a pipeline schedule) is the model parts' business (`scalerl.parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scalerl.models.packing import packed_batch_or_none
from scalerl.models.routing_replay import replaying_routes
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


def _forward_inputs(parts: ModelParts, mini: RolloutBatch, plan: UpdatePlan, objective, ctx,
                    routes: list | None = None) -> list[MicroBatch]:
    """The micro-batches' forward inputs; ``routes``, when a list, takes each one's recorded routed experts."""
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
    if routes is not None:
        routes.extend(m.routed_experts for m in micros)
    return [MicroBatch(*packed_batch_or_none(m.input_ids, m.attention_mask, packed,
                                             m.response_mask > 0 if objective.packed_outputs else None),
                       objective.target(m), objective.keep(m)) for m in micros]


class UpdateRun:
    """`run_update` in pieces, for a streaming trainer (``rollout.stream_groups``): the first epoch's
    mini-batches may run as their rows arrive (`next_rows` names the rows the next one needs, `run_next` runs
    it), and `finish` runs the rest on the whole batch. The first epoch's row order is drawn when the
    run is made, from the same generator at the same point as `run_update` draws it, so a run that takes some
    mini-batches early steps exactly as one that takes them all at the end."""

    def __init__(self, parts: ModelParts, step: OptimizerStep, objective: MicroBatchObjective, plan: UpdatePlan,
                 generator: torch.Generator | None, ctx: DistContext, autocast, rows: int, device):
        self.parts, self.step, self.objective, self.plan = parts, step, objective, plan
        self.generator, self.ctx, self.autocast, self.rows, self.device = generator, ctx, autocast, rows, device
        self.first_order = self._order()
        self.first_done = 0  # first-epoch mini-batches run
        self.norms: list[torch.Tensor] = []
        self.skipped: list[torch.Tensor] = []
        # The forward's token slots (padding included, from shapes: no sync) and the real tokens among them,
        # for the MFU waterfall's padding slice (`scalerl.perf.mfu_waterfall`).
        self.token_slots, self.real_tokens = 0, torch.zeros((), device=device)

    def _order(self) -> torch.Tensor:
        if self.plan.shuffle:
            return torch.randperm(self.rows, generator=self.generator).to(self.device)
        return torch.arange(self.rows, device=self.device)

    def next_rows(self) -> torch.Tensor | None:
        """The rows (in the batch's numbering) of the next first-epoch mini-batch; None once they all ran."""
        start = self.first_done * self.plan.mini_batch_size
        return self.first_order[start : start + self.plan.mini_batch_size] if start < self.rows else None

    def run_next(self, mini: RolloutBatch) -> None:
        """The next first-epoch mini-batch: ``mini`` holds the rows `next_rows` names, in that order."""
        self._step(mini)
        self.first_done += 1

    def _step(self, mini: RolloutBatch) -> None:
        """One optimizer step on ``mini``."""
        objective, step = self.objective, self.step
        self.parts.train()
        objective.start_mini_batch(mini_batch_counts(mini, self.ctx, self.plan.horizon))
        step.optimizer.zero_grad(set_to_none=True)
        # actor.router_replay: each micro-batch's forward routes by its rows' recorded experts
        routes = [] if objective.replays_routes and mini.routed_experts is not None else None
        micros = _forward_inputs(self.parts, mini, self.plan, objective, self.ctx, routes)
        self.token_slots += sum(m.input_ids.numel() for m in micros)
        self.real_tokens = self.real_tokens + mini.attention_mask.sum()
        with replaying_routes(self.parts.model, routes):
            calls = self.parts.forward_backward(micros, objective, self.autocast, step.grad_scaler)
        objective.end_mini_batch(calls)
        norm, was_skipped = step(self.parts)
        # Free the gradients now, not at the next mini-batch: after the last one they would otherwise stay
        # alive through generation, the weight sync and the checkpoint (a whole model's worth, measured on
        # the 0.5B-shaped plan cell: RSS 0.98 GiB held against 0.87 once freed).
        step.optimizer.zero_grad(set_to_none=True)
        self.norms.append(norm)
        self.skipped.append(was_skipped)

    def finish(self, batch: RolloutBatch) -> dict[str, float]:
        """The first epoch's remaining mini-batches and every later epoch on ``batch``; the update's metrics."""
        if len(batch) != self.rows:
            raise ValueError(f"update planned for {self.rows} rows got a batch of {len(batch)}")
        size = self.plan.mini_batch_size
        for epoch in range(self.plan.epochs):
            order = self.first_order if epoch == 0 else self._order()
            for start in range(self.first_done * size if epoch == 0 else 0, self.rows, size):
                mini = batch.select(order[start : start + size])
                self.run_next(mini) if epoch == 0 else self._step(mini)
        objective, parts = self.objective, self.parts
        metrics = parts.share_loss_metrics(objective.summary(), objective.metric_names)
        prefix = objective.metric_names[0].split("/")[0]
        metrics[f"{prefix}/grad_norm"] = float(torch.stack(self.norms).float().mean())
        flags = torch.stack(self.skipped).tolist()
        self.step.count_skips(flags)
        metrics[f"{prefix}/skipped_steps"] = float(sum(flags))
        metrics[f"perf/token_slots/{prefix}"] = float(self.token_slots)
        metrics[f"perf/real_tokens/{prefix}"] = float(self.real_tokens)  # after the flags' sync: no new wait
        router_aux = getattr(parts, "router_aux", None)
        if router_aux is not None:  # MoE: moe/aux_loss and moe/expert_load_imbalance over the step's DP ranks
            moe = router_aux.metrics(self.ctx.all_reduce)
            metrics.update({f"critic/{k}" if prefix == "critic" else k: v for k, v in moe.items()})
        return metrics


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
    return UpdateRun(parts, step, objective, plan, generator, ctx, autocast, len(batch),
                     batch.input_ids.device).finish(batch)
