"""Off-policy corrections for rollouts sampled by other weights or numerics than the policy the loss is taken
against (standalone bf16 workers, weights K versions stale, another engine): per-token importance weights
that multiply the policy loss (verl's ``rollout_is_weights``, TRL's ``vllm_importance_sampling_ratio``).

With r = exp(proximal - behaviour) the log-prob ratio of the policy PPO clips against (the recomputed old
log-probs) over the one that sampled (the engine's log-probs):

- level ``token``: one weight per token, r_t; level ``sequence``: one per sequence, exp(sum_t m_t log r_t),
  carried by all its tokens (verl's ``rollout_is=sequence``, TRL's ``sequence_*`` modes);
- mode ``truncate``: min(w, cap) (verl's TIS, TRL's ``*_truncate``); mode ``mask``: w where w <= cap, else 0
  (TRL's ``*_mask``, AReaL's ``behav_imp_weight_cap``).

Decoupled PPO (AReaL) is the token level with the mask: the ratio is clipped against the proximal policy
(the recomputed old log-probs) and each token's loss weighted by exp(proximal - behaviour), zero above the
cap. The log-ratio is clamped to +-20 before the exp, as verl's ``SAFETY_BOUND``.
"""

from __future__ import annotations

import torch

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
SAFETY_BOUND = 20.0


def rollout_correction_weights(proximal_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
                               level: str = "token", mode: str = "truncate",
                               cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights [B, T] (zero on padding) and their metrics:

    - ``rollout/logprob_diff/{mean,max}``: |proximal - behaviour| over valid tokens (the mismatch);
    - ``rollout_corr/rollout_is_mean`` / ``_max``: the weights before the cap (verl's, over valid tokens);
    - ``rollout_corr/rollout_is_ratio_fraction_high``: the share of weights (tokens, or sequences at the
      sequence level) above the cap, the ones truncated or masked;
    - ``rollout_corr/weight_mean``: the weights applied, after the cap, over valid tokens.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"importance sampling level {level!r}; choose one of {IS_LEVELS}")
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode {mode!r}; choose one of {IS_MODES}")
    if not cap > 0:
        raise ValueError(f"importance sampling cap must be > 0, got {cap}")
    mask = mask.to(proximal_logp.dtype)
    valid = mask.bool()
    log_ratio = (proximal_logp - behavior_logp) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
        rows = valid.any(-1, keepdim=True)  # a sequence with no valid token has no weight to count
    raw = torch.exp(log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND))
    high = raw > cap
    applied = raw.clamp(max=cap) if mode == "truncate" else raw.masked_fill(high, 0.0)
    weights = applied.expand_as(mask) * mask
    raw_tokens = raw.expand_as(mask)[valid]
    high_share = high[rows] if level == "sequence" else high[valid]
    diff = (proximal_logp - behavior_logp).abs()[valid]
    count = max(int(valid.sum()), 1)
    stats = {
        "rollout/logprob_diff/mean": float(diff.mean()) if diff.numel() else 0.0,
        "rollout/logprob_diff/max": float(diff.max()) if diff.numel() else 0.0,
        "rollout_corr/rollout_is_mean": float(raw_tokens.sum()) / count,
        "rollout_corr/rollout_is_max": float(raw_tokens.max()) if raw_tokens.numel() else 0.0,
        "rollout_corr/rollout_is_ratio_fraction_high": float(high_share.float().mean()) if high_share.numel() else 0.0,
        "rollout_corr/weight_mean": float(weights[valid].sum()) / count,
    }
    return weights.detach(), stats


def truncated_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                                 cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level truncated weights ``min(exp(old_logp - rollout_logp), cap)`` (verl's TIS) and the
    mismatch ``rollout/logprob_diff/{mean,max}``: `rollout_correction_weights` at its defaults."""
    weights, stats = rollout_correction_weights(old_logp, rollout_logp, mask, "token", "truncate", cap)
    return weights, {k: v for k, v in stats.items() if k.startswith("rollout/logprob_diff")}
