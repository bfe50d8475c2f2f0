"""The policy side of an RL step: log-probs of responses, and PPO-clip mini-batch updates."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator

import torch

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


def _pad_right(t: torch.Tensor, right: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, right)) if right else t


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
) -> dict[str, float]:
    """``ppo_epochs`` x shuffled mini-batches x micro-batches (gradient accumulation) of PPO-clip.

    Each micro-batch loss is aggregated against the *mini-batch's* token/sequence counts, so summing the
    micro-batch gradients gives exactly the full mini-batch loss's gradient (no 1/num_micro fudge).
    """
    cfg = actor_cfg
    n = len(batch)
    stats: dict[str, list[tuple[float, float]]] = defaultdict(list)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=generator).to(batch.input_ids.device)
        for start in range(0, n, cfg.ppo_mini_batch_size):
            mini = batch.select(order[start : start + cfg.ppo_mini_batch_size])
            num_tokens = mini.response_mask.sum()
            num_seqs = (mini.response_mask.sum(-1) > 0).sum()
            agg = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs, horizon=horizon)
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(mini, cfg.ppo_micro_batch_size):
                micro, _, _ = micro.trimmed()
                weight = micro.response_mask.sum() / num_tokens.clamp(min=1)
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
                (grad_scaler.scale(loss) if grad_scaler else loss).backward()
                stats["actor/pg_loss"].append((pg_loss.detach(), 1.0))  # parts of the mini-batch loss: summed
                stats["actor/entropy"].append(((entropy.detach() * micro.response_mask).sum() / num_tokens, 1.0))
                for key, value in pg_metrics.items():
                    stats[f"actor/{key}"].append((value, weight))
            if grad_scaler:
                grad_scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
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
