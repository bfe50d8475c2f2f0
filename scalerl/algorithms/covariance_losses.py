"""Clip-Cov and KL-Cov (verl `clip_cov`, `kl_cov`; "The Entropy Mechanism of RL for Reasoning LMs",
arXiv 2505.22617): PPO losses that act on the few tokens whose centred advantage x log-prob covariance is
largest, the tokens that drive the policy's entropy down.

Same calling convention as `policy_losses`: per-token matrix, optional ``token_weights``, then
`aggregate_loss(matrix, mask, agg, **agg_counts)`. Token selection uses this call's tokens (a micro-batch),
as verl does. Neither clamps the log-ratio before the exp, as in verl.
"""

from __future__ import annotations

import torch

from scalerl.algorithms.losses import aggregate_loss
from scalerl.algorithms.masked import masked_mean

Metrics = dict[str, torch.Tensor]


def clip_cov_loss(old_logp, logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2,
                  clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                  agg: str = "token-mean", token_weights=None, generator: torch.Generator | None = None,
                  **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO-clip, plus the gradient of a random few high-covariance tokens switched off.

        r = exp(logp - old_logp),  l1 = -A r,  l2 = -A clip(r, 1 - clip_low, 1 + clip_high)
        cov = (A - mean_m A) (logp - mean_m logp)     (detached; -inf on padding and where l2 > l1)
        candidates: clip_cov_lb < cov < clip_cov_ub;  pick max(int(clip_cov_ratio * sum m), 1) of them at
        random (``generator``, else torch's global one; verl draws `torch.randperm` from the global one)
        l = max(l1, l2) * (0 on the picked tokens, 1 elsewhere)
    Metrics: pg_clipfrac = share of picked tokens, ppo_kl = mean(old_logp - logp).
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    with torch.no_grad():
        valid = response_mask > 0
        cov = (advantages - masked_mean(advantages, response_mask)) * (logp - masked_mean(logp, response_mask))
        cov = cov.masked_fill(~valid | ((clipped > unclipped) & valid), float("-inf"))
        num_to_clip = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & valid)
        keep = torch.ones_like(advantages)
        if len(candidates) > 0:
            order = torch.randperm(len(candidates), generator=generator).to(candidates.device)
            picked = candidates[order[: min(num_to_clip, len(candidates))]]
            keep[picked[:, 0], picked[:, 1]] = 0
    token_losses = torch.maximum(unclipped, clipped) * keep
    if token_weights is not None:
        token_losses = token_losses * token_weights
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean((keep == 0).to(logp.dtype), response_mask),
                   "ppo_kl": masked_mean(-log_ratio, response_mask)}
    return loss, metrics


def kl_cov_loss(old_logp, logp, advantages, response_mask, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1,
                agg: str = "token-mean", token_weights=None, **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: unclipped policy gradient, plus a |log-ratio| penalty on the highest-covariance tokens.

        r = exp(logp - old_logp),  l = -A r  +  ppo_kl_coef * |logp - old_logp|  on the top
        max(1, int(n * kl_cov_ratio)) valid tokens by cov = (A - mean A)(logp - mean logp) (over the n
        valid tokens, detached),  l = -A r  elsewhere.
    Metrics: ppo_kl = mean |logp - old_logp| (verl logs the absolute value under this name).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    log_ratio = logp - old_logp
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    plain = -advantages * ratio
    penalised = -advantages * ratio + ppo_kl_coef * abs_kl
    with torch.no_grad():
        valid = (response_mask > 0).reshape(-1)
        valid_positions = torch.nonzero(valid, as_tuple=True)[0]
        selected = torch.zeros_like(valid)
        if valid_positions.numel() > 0:
            valid_adv = advantages.reshape(-1)[valid_positions]
            valid_logp = logp.detach().reshape(-1)[valid_positions]
            cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
            num_selected = max(1, int(len(cov) * kl_cov_ratio))
            selected[valid_positions[torch.topk(cov, num_selected, largest=True).indices]] = True
    token_losses = torch.where(selected.reshape(advantages.shape), penalised, plain)
    if token_weights is not None:
        token_losses = token_losses * token_weights
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(abs_kl, response_mask)}
    return loss, metrics
