"""RL and SFT updates through pipeline stages: the losses the last stage computes, and the update loops.

The losses are the same functions as the non-pipeline paths (`policy_loss`, `aggregate_loss`, token-mean
cross-entropy) with the same global-count normalisation, so micro-batch losses add up to the mini-batch
loss. What the last stage needs besides logits travels as one float ``target`` tensor per row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from scalerl.parallel.distributed import DistContext
from scalerl.parallel.grad_norm import clip_grad_norm
from scalerl.parallel.pipeline import PipelineRunner
from scalerl.rl.actor import aggregation_counts
from scalerl.rl.batch import RolloutBatch
from scalerl.rl.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.rl.kl import kl_penalty
from scalerl.rl.losses import aggregate_loss, policy_loss

_RL_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl",
               "actor/pg_clipfrac_lower")


class PolicyLossOnLastStage:
    """``loss(logits, target)`` for one micro-batch; ``target[..., :]`` = (response ids, mask, old log-prob,
    advantage, reference log-prob) per response token."""

    def __init__(self, actor_cfg: Any, temperature: float, horizon: int):
        self.cfg, self.temperature, self.horizon = actor_cfg, temperature, horizon
        self.agg: dict = {}
        self.records: list[dict[str, torch.Tensor]] = []

    @staticmethod
    def target(batch: RolloutBatch) -> torch.Tensor:
        ref = batch.ref_logprobs if batch.ref_logprobs is not None else torch.zeros_like(batch.old_logprobs)
        return torch.stack([batch.response_ids.float(), batch.response_mask, batch.old_logprobs,
                            batch.advantages, ref], dim=-1)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        response_len = target.shape[1]
        logits = logits[:, -response_len - 1 : -1].float()
        if self.temperature not in (0.0, 1.0):
            logits = logits / self.temperature
        ids, mask, old, adv, ref = target.long()[..., 0], *target[..., 1:].unbind(-1)
        logp = logprobs_from_logits(logits, ids)
        pg_loss, metrics = policy_loss(old, logp, adv, mask, clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                                       clip_c=cfg.clip_ratio_c, agg=cfg.loss_agg_mode, **self.agg)
        loss = pg_loss
        entropy = entropy_from_logits(logits if cfg.entropy_coeff else logits.detach())
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * aggregate_loss(entropy, mask, cfg.loss_agg_mode, **self.agg)
        record = {"actor/pg_loss": pg_loss.detach(),
                  "actor/entropy": (entropy.detach() * mask).sum() / self.agg["global_num_tokens"] * self.agg["dp_size"]}
        if cfg.use_kl_loss:
            kl_loss = aggregate_loss(kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode, **self.agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            record["actor/kl_loss"] = kl_loss.detach()
        weight = mask.sum() / self.agg["global_num_tokens"] * self.agg["dp_size"]
        record.update({f"actor/{k}": v * weight for k, v in metrics.items()})
        self.records.append(record)
        return loss


def _broadcast_from_last_stage(values: dict[str, float], keys, runner: PipelineRunner, ctx: DistContext) -> dict:
    """Metrics live on the last stage; every pipeline rank (rank 0 logs) gets them."""
    t = torch.tensor([values.get(k, float("nan")) for k in keys], dtype=torch.float64, device=ctx.device)
    last_owner = dist.get_process_group_ranks(runner.pp_group)[runner.owner[runner.num_stages - 1]]
    dist.broadcast(t, src=last_owner, group=runner.pp_group)
    return {k: v for k, v in zip(keys, t.tolist()) if v == v}


def update_policy_pipeline(
    runner: PipelineRunner, optimizer, batch: RolloutBatch, actor_cfg: Any, loss_fn: PolicyLossOnLastStage,
    generator: torch.Generator, ctx: DistContext,
) -> dict[str, float]:
    """The pipeline counterpart of `update_policy`: epochs x mini-batches, each one schedule step."""
    cfg = actor_cfg
    mini_size = cfg.ppo_mini_batch_size // ctx.dp_size
    sums: dict[str, float] = {}
    norms = []
    minis = 0
    runner.train()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator).to(batch.input_ids.device)
        for start in range(0, len(batch), mini_size):
            mini = batch.select(order[start : start + mini_size])
            loss_fn.agg = aggregation_counts(mini, ctx, loss_fn.horizon)
            loss_fn.records = []
            optimizer.zero_grad(set_to_none=True)
            runner.step(mini.input_ids, mini.attention_mask, PolicyLossOnLastStage.target(mini))
            runner.sync_tied_gradients()
            norms.append(clip_grad_norm(runner.parameters(), cfg.grad_clip, runner.norm_parameters(), runner.pp_group))
            optimizer.step()
            # The schedule's first step may call the loss once more while it infers shapes: keep the
            # records of the real micro-batches, which come last.
            for record in loss_fn.records[-runner.microbatches:]:
                for k, v in record.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
            minis += 1
    local = {k: v / minis for k, v in sums.items()}
    out = _broadcast_from_last_stage(local, _RL_METRICS, runner, ctx)
    out["actor/grad_norm"] = float(torch.stack(norms).mean())
    return out


class SFTLossOnLastStage:
    """Token-mean cross-entropy over the loss mask; ``target`` = (next token ids, loss mask)."""

    def __init__(self):
        self.num_tokens, self.dp_size, self.losses = None, 1, []

    @staticmethod
    def target(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1)).float()
        mask = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1))
        return torch.stack([ids, mask], dim=-1)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logp = logprobs_from_logits(logits.float(), target[..., 0].long())
        loss = -(logp * target[..., 1]).sum() / self.num_tokens * self.dp_size
        self.losses.append(loss.detach())
        return loss


def sft_step_pipeline(runner: PipelineRunner, batch: dict[str, torch.Tensor], loss_fn: SFTLossOnLastStage,
                      num_tokens: torch.Tensor, ctx: DistContext) -> float:
    """One SFT mini-batch through the pipeline; returns the loss (broadcast from the last stage)."""
    loss_fn.num_tokens, loss_fn.dp_size, loss_fn.losses = num_tokens, ctx.dp_size, []
    runner.train()
    runner.step(batch["input_ids"], batch["attention_mask"], SFTLossOnLastStage.target(batch))
    runner.sync_tied_gradients()
    total = float(sum(loss_fn.losses[-runner.microbatches:])) if loss_fn.losses else float("nan")
    return _broadcast_from_last_stage({"sft/loss": total}, ("sft/loss",), runner, ctx)["sft/loss"]
