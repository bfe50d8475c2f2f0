"""The policy side of an RL step: log-probs of responses, and PPO-clip mini-batch updates."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator

import torch
import torch.distributed as dist

from scalerl.parallel.balance import token_budget_micro_batches
from scalerl.parallel.distributed import DistContext, single_process_context
from scalerl.parallel.grad_norm import clip_grad_norm, trainable_parameters
from scalerl.rl.batch import RolloutBatch
from scalerl.rl.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.rl.kl import kl_penalty
from scalerl.rl.losses import aggregate_loss, policy_loss


def response_logits(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Logits ``[B, R, V]`` that predict each response token (position ``P - 1 + t`` predicts token ``t``),
    divided by the sampling temperature so log-probs match the sampler's."""
    response_len = batch.response_ids.shape[1]
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=response_len + 1)
    logits = logits[:, :-1].float()
    return logits / temperature if temperature not in (0.0, 1.0) else logits


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    for start in range(0, len(batch), size):
        yield batch.select(torch.arange(start, min(start + size, len(batch)), device=batch.input_ids.device))


def token_budget_batches(batch: RolloutBatch, max_tokens: int, ctx: DistContext) -> list[RolloutBatch]:
    """Dynamic batch size: micro-batches packed up to ``max_tokens`` padded tokens. Ranks agree on the
    count (the largest any rank needs), since sharded/TP forwards must run in lockstep."""
    lengths = batch.attention_mask.sum(-1).tolist()
    groups = token_budget_micro_batches(lengths, max_tokens)
    if ctx.world_size > 1:
        count = torch.tensor([len(groups)], device=ctx.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        groups = token_budget_micro_batches(lengths, max_tokens, same_count_across=int(count))
    device = batch.input_ids.device
    return [batch.select(torch.tensor(sorted(g), device=device)) for g in groups]


def _pad_right(t: torch.Tensor, right: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, right)) if right else t


def aggregation_counts(mini: RolloutBatch, ctx: DistContext, horizon: int) -> dict[str, Any]:
    """The `aggregate_loss` keyword arguments for one mini-batch: its valid tokens and sequences summed over
    the data-parallel ranks (one all-reduce), the DP size gradients are averaged over, and the horizon."""
    counts = ctx.all_reduce(torch.stack([mini.response_mask.sum(), (mini.response_mask.sum(-1) > 0).sum().float()]))
    return dict(global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=ctx.dp_size, horizon=horizon)


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float, micro_batch_size: int, autocast=None
) -> torch.Tensor:
    """Per-token log-probs ``[B, R]`` of the batch's responses under ``model`` (zero on padding)."""
    out = []
    for micro in micro_batches(batch, micro_batch_size):
        micro, _, right = micro.trimmed()
        with autocast or contextlib.nullcontext():
            logits = response_logits(model, micro, temperature)
        logp = logprobs_from_logits(logits, micro.response_ids) * micro.response_mask
        out.append(_pad_right(logp, right))
    return torch.cat(out)


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    actor_cfg: Any,
    temperature: float,
    horizon: int,
    generator: torch.Generator,
    autocast=None,
    grad_scaler: torch.amp.GradScaler | None = None,
    dist_ctx: DistContext | None = None,
) -> dict[str, float]:
    """``ppo_epochs`` x shuffled mini-batches x micro-batches (gradient accumulation) of PPO-clip.

    Each micro-batch loss is aggregated against the *mini-batch's* token/sequence counts summed over the
    data-parallel ranks, scaled by the DP size that DDP/FSDP average gradients over, so the gradient equals
    the single-process full mini-batch gradient (no 1/num_micro fudge). ``batch`` holds this rank's rows;
    a mini-batch takes ``ppo_mini_batch_size / dp`` of them.
    """
    cfg = actor_cfg
    ctx = dist_ctx or single_process_context()
    n = len(batch)
    mini_size = cfg.ppo_mini_batch_size // ctx.dp_size
    stats: dict[str, list[tuple[float, float]]] = defaultdict(list)
    model.train()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=generator).to(batch.input_ids.device)
        for start in range(0, n, mini_size):
            mini = batch.select(order[start : start + mini_size])
            agg = aggregation_counts(mini, ctx, horizon)
            num_tokens = agg["global_num_tokens"]
            optimizer.zero_grad(set_to_none=True)
            if cfg.micro_batch_max_tokens:
                micros = token_budget_batches(mini, cfg.micro_batch_max_tokens, ctx)
            else:
                micros = list(micro_batches(mini, cfg.ppo_micro_batch_size))
            for i, micro in enumerate(micros):
                micro, _, _ = micro.trimmed()
                weight = micro.response_mask.sum() / num_tokens.clamp(min=1) * ctx.dp_size  # averaged over ranks later
                with autocast or contextlib.nullcontext():
                    logits = response_logits(model, micro, temperature)
                logp = logprobs_from_logits(logits, micro.response_ids)
                pg_loss, pg_metrics = policy_loss(
                    micro.old_logprobs, logp, micro.advantages, micro.response_mask,
                    clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c,
                    agg=cfg.loss_agg_mode, **agg,
                )
                loss = pg_loss
                if cfg.entropy_coeff:
                    entropy = entropy_from_logits(logits)
                    entropy_loss = aggregate_loss(entropy, micro.response_mask, cfg.loss_agg_mode, **agg)
                    loss = loss - cfg.entropy_coeff * entropy_loss
                else:
                    with torch.no_grad():
                        entropy = entropy_from_logits(logits)
                if cfg.use_kl_loss:
                    kl = kl_penalty(logp, micro.ref_logprobs, cfg.kl_loss_type)
                    kl_loss = aggregate_loss(kl, micro.response_mask, cfg.loss_agg_mode, **agg)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                    stats["actor/kl_loss"].append((kl_loss.detach(), 1.0))
                # DDP all-reduces only on the last micro-batch's backward; FSDP reduces every time.
                sync = getattr(model, "no_sync", None) if i < len(micros) - 1 else None
                with sync() if sync else contextlib.nullcontext():
                    (grad_scaler.scale(loss) if grad_scaler else loss).backward()
                stats["actor/pg_loss"].append((pg_loss.detach(), 1.0))  # parts of the mini-batch loss: summed
                stats["actor/entropy"].append(((entropy.detach() * micro.response_mask).sum() / num_tokens * ctx.dp_size, 1.0))
                for key, value in pg_metrics.items():
                    stats[f"actor/{key}"].append((value, weight))
            if grad_scaler:
                grad_scaler.unscale_(optimizer)
            grad_norm = clip_grad_norm(trainable_parameters(model), cfg.grad_clip)
            if grad_scaler:
                grad_scaler.step(optimizer)  # skips the step itself on inf/nan
                grad_scaler.update()
            elif torch.isfinite(grad_norm):
                optimizer.step()
            else:
                stats["actor/skipped_steps"].append((1.0, 1.0))
            stats["actor/grad_norm"].append((grad_norm.detach(), 1.0))
            stats["_mini_batches"].append((1.0, 1.0))
    return _reduce_stats(stats)


def _reduce_stats(stats: dict[str, list[tuple[Any, Any]]]) -> dict[str, float]:
    """Per-mini-batch sums for losses (micro-batch parts add up), averaged over mini-batches; weighted
    means for the rest. Values stay device tensors until here: one sync per step, not per micro-batch."""
    num_minis = len(stats.pop("_mini_batches", [])) or 1
    out = {}
    for key, values in stats.items():
        if key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/skipped_steps"):
            out[key] = sum(v for v, _ in values) / num_minis
        elif key == "actor/grad_norm":
            out[key] = sum(v for v, _ in values) / len(values)
        else:
            out[key] = sum(v * w for v, w in values) / num_minis
    return {k: float(v) for k, v in out.items()}
