"""Truncated importance sampling (verl's TIS) for rollouts sampled by other weights or numerics than the
policy the loss is taken against (standalone bf16 workers, one-step-stale weights, another engine)."""

from __future__ import annotations

import torch


def truncated_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                                 cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights ``min(exp(old_logp - rollout_logp), cap)`` (zero on padding), and the mismatch
    ``rollout/logprob_diff/{mean,max}`` = |old - rollout| over valid tokens. The log-ratio is clamped at 20
    before the exp, as the policy loss's ratio is."""
    valid = mask.bool()
    diff = (old_logp - rollout_logp).abs()[valid]
    weights = torch.exp((old_logp - rollout_logp).clamp(max=20.0)).clamp(max=cap) * mask
    stats = {"rollout/logprob_diff/mean": float(diff.mean()) if diff.numel() else 0.0,
             "rollout/logprob_diff/max": float(diff.max()) if diff.numel() else 0.0}
    return weights, stats
