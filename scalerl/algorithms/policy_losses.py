"""Policy-gradient losses beyond dual-clip PPO (which is `losses.policy_loss`): GSPO, SAPO, CISPO, GPG,
GMPO (geo_mean), DRO and DPPO's binary-TV and binary-KL trust regions. The covariance-based ones (clip-cov,
kl-cov) are in `covariance_losses`, verl's bypass mode in `bypass_mode`.

Every loss takes [B, T] log-probs of the sampled tokens under the old and the current policy, advantages
and the response mask, builds a per-token loss matrix in verl's order of operations (`core_algos.py`),
multiplies it by ``token_weights`` (verl's rollout_is_weights) when given, and reduces it with
`aggregate_loss(matrix, mask, agg, **agg_counts)`: every aggregation mode and the global token / sequence
counts that make micro-batches and DP ranks add up to the full batch (see `losses`). Returns
`(loss, metrics)`; the metrics are detached scalars under verl's names without the ``actor/`` prefix.
"""

from __future__ import annotations

import torch

from scalerl.algorithms.losses import LOG_RATIO_CLAMP, aggregate_loss
from scalerl.algorithms.masked import COUNT_EPS, masked_mean, masked_sum

Metrics = dict[str, torch.Tensor]


def _weighted(token_losses: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    return token_losses if token_weights is None else token_losses * token_weights


def _clip_metrics(clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor | None) -> Metrics:
    lower = torch.zeros_like(ppo_kl) if clipfrac_lower is None else clipfrac_lower
    return {"pg_clipfrac": clipfrac.detach(), "ppo_kl": ppo_kl.detach(), "pg_clipfrac_lower": lower.detach()}


def gspo_loss(old_logp, logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2,
              agg: str = "seq-mean-token-mean", token_weights=None, **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """GSPO (verl `gspo`, arXiv 2507.18071): one importance ratio per sequence, the geometric mean of its
    token ratios, carried by every token with the token's own gradient:
        log s_i   = sum_t m_it (logp - old_logp)_it / max(n_i, 1)
        s_it      = exp(min(sg[log s_i] + logp_it - sg[logp_it], 10))
        l_it      = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))
    Metrics: pg_clipfrac (clipped term larger), ppo_kl = mean(old_logp - logp), pg_clipfrac_lower = 0.
    verl always aggregates GSPO with seq-mean-token-mean; here ``agg`` decides (that is the default).
    """
    log_ratio = logp - old_logp
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / seq_lengths
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    token_losses = _weighted(torch.maximum(unclipped, clipped), token_weights)
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(logp.dtype), response_mask)
        metrics = _clip_metrics(clipfrac, masked_mean(-log_ratio, response_mask), None)
    return loss, metrics


def sapo_loss(old_logp, logp, advantages, response_mask, tau_pos: float = 1.0, tau_neg: float = 1.05,
              agg: str = "seq-mean-token-mean", token_weights=None, **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """SAPO (verl `sapo`, arXiv 2511.20347): a smooth sigmoid gate instead of the hard clip.
        r = exp(clamp(logp - old_logp, -20, 20)),  tau = tau_pos if A > 0 else tau_neg
        l = -A * sigmoid(tau (r - 1)) * 4 / tau
    Metrics: ppo_kl; pg_clipfrac = pg_clipfrac_lower = 0. verl 0.9.1 always aggregates seq-mean-token-mean
    (the registry entry passes that); ``agg`` decides here.
    """
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
                       torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    token_losses = _weighted(-gates * advantages, token_weights)
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, response_mask)
        metrics = _clip_metrics(torch.zeros_like(ppo_kl), ppo_kl, None)
    return loss, metrics


def cispo_loss(old_logp, logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2,
               agg: str = "token-mean", token_weights=None, **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """CISPO (verl `cispo`, arXiv 2506.13585): REINFORCE weighted by the clipped, stop-gradient ratio.
        r = exp(clamp(logp - old_logp, -20, 20)),  l = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logp
    Metrics: pg_clipfrac = share of tokens whose ratio was clipped, ppo_kl, pg_clipfrac_lower = 0.
    """
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    token_losses = _weighted(-clipped_ratio.detach() * advantages * logp, token_weights)
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    with torch.no_grad():
        clipfrac = masked_mean((ratio != clipped_ratio).to(logp.dtype), response_mask)
        metrics = _clip_metrics(clipfrac, masked_mean(-log_ratio, response_mask), None)
    return loss, metrics


def gpg_loss(old_logp, logp, advantages, response_mask, agg: str = "token-mean", token_weights=None,
             **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """GPG (verl `gpg`): plain policy gradient, l = -logp * A (``old_logp`` unused). No metrics, as in verl."""
    token_losses = _weighted(-logp * advantages, token_weights)
    return aggregate_loss(token_losses, response_mask, agg, **agg_counts), {}


def geo_mean_loss(old_logp, logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2,
                  agg: str | None = None, token_weights=None,
                  **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """GMPO (verl `geo_mean`, arXiv 2507.20673): the geometric mean of the token ratios, clipped per token in
    log space on the side that the advantage's sign makes pessimistic:
        d = logp - old_logp (no clamp),  d_c = clamp(d, -clip_low, clip_high)
        d* = sgn(A) * min(sgn(A) d, sgn(A) d_c)
        r_i = exp(sum_t m d* / (n_i + 1e-8)),  A_i = sum_t m A / (n_i + 1e-8),  l_i = -A_i r_i
    ``token_weights`` enter as their per-sequence geometric mean. ``agg`` None (the default) is verl's
    reduction: mean_i l_i over every row of this call, empty rows included, whatever the global counts, so
    with several micro-batches their losses add up to more than one batch mean, as in verl 0.9.1. With an
    aggregation mode, l_i is carried by each valid token of row i and reduced by `aggregate_loss` (normalised
    across micro-batches and ranks; seq-mean-token-mean equals verl's when every row has a valid token).
    Metrics: pg_clipfrac / pg_clipfrac_lower = share of tokens with d != d_c and A > 0 / A < 0; ppo_kl.
    """
    log_ratio = logp - old_logp
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_low, clip_high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(dim=-1)
    seq_ratio = torch.exp(masked_sum(pessimistic, response_mask, dim=-1) / (lengths + COUNT_EPS))
    seq_advantage = masked_sum(advantages, response_mask, dim=-1) / (lengths + COUNT_EPS)
    seq_losses = -seq_advantage * seq_ratio
    if token_weights is not None:
        log_weights = masked_sum(torch.log(token_weights + 1e-10), response_mask, dim=-1)
        seq_losses = seq_losses * torch.exp(log_weights / (lengths + COUNT_EPS))
    if agg is None:
        loss = seq_losses.mean()
    else:
        loss = aggregate_loss(seq_losses.unsqueeze(-1).expand_as(log_ratio), response_mask, agg, **agg_counts)
    with torch.no_grad():
        was_clipped = log_ratio != clamped
        metrics = _clip_metrics(masked_mean((was_clipped & (advantages > 0)).to(logp.dtype), response_mask),
                                masked_mean(-log_ratio, response_mask),
                                masked_mean((was_clipped & (advantages < 0)).to(logp.dtype), response_mask))
    return loss, metrics


def dro_loss(old_logp, logp, advantages, response_mask, beta: float | None, agg: str = "token-mean",
             token_weights=None, **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """DRO (verl 0.9.1 `dro`, Direct Reward Optimization): REINFORCE with a quadratic penalty on the log-ratio,
        l = -(A logp - beta / 2 (logp - old_logp)^2)      (no clamp, no clip)
    ``beta`` is verl's actor.policy_loss.dro_beta, which has no default: it must be given and > 0.
    Metrics: ppo_kl only, as in verl.
    """
    if beta is None or not beta > 0:
        raise ValueError(f"policy loss 'dro' needs dro_beta > 0 (verl's actor.policy_loss.dro_beta), got {beta}")
    log_ratio = logp - old_logp
    token_losses = _weighted(-(logp * advantages - 0.5 * beta * log_ratio.square()), token_weights)
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    return loss, {"ppo_kl": masked_mean(-log_ratio, response_mask).detach()}


def _dppo(old_logp, logp, advantages, response_mask, inside, clip_c, agg, token_weights, agg_counts):
    """DPPO's shared body: truncated-IS policy gradient on the tokens inside the trust region (``inside``)."""
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    truncated_ratio = torch.clamp(ratio, max=clip_c).detach()
    valid = inside.detach().to(logp.dtype)
    token_losses = _weighted(-advantages * truncated_ratio * logp * valid, token_weights)
    loss = aggregate_loss(token_losses, response_mask, agg, **agg_counts)
    with torch.no_grad():
        metrics = _clip_metrics(masked_mean(1.0 - valid, response_mask), masked_mean(-log_ratio, response_mask),
                                masked_mean((ratio > clip_c).to(logp.dtype) * valid, response_mask))
    return loss, metrics


def dppo_tv_loss(old_logp, logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2,
                 clip_c: float = 20.0, agg: str = "token-mean", token_weights=None,
                 **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV (verl `dppo_tv`, arXiv 2602.04879): a trust region on the sampled token's probability
    p = exp(logp) against p_old, with clip_low / clip_high as TV thresholds (not ratio bounds):
        inside = (p - p_old <= clip_high) if A > 0 else (p - p_old >= -clip_low)
        l = -A * sg[min(r, clip_c)] * logp * inside,   r = exp(clamp(logp - old_logp, -20, 20))
    Metrics: pg_clipfrac = share outside the region, pg_clipfrac_lower = share inside with r > clip_c, ppo_kl.
    """
    delta = torch.exp(logp) - torch.exp(old_logp)
    inside = torch.where(advantages > 0, delta <= clip_high, delta >= -clip_low)
    return _dppo(old_logp, logp, advantages, response_mask, inside, clip_c, agg, token_weights, agg_counts)


def dppo_kl_loss(old_logp, logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2,
                 clip_c: float = 20.0, agg: str = "token-mean", token_weights=None,
                 **agg_counts) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (verl `dppo_kl`): as `dppo_tv` with the Bernoulli KL of the sampled token,
        KL_b = p_old (old_logp - logp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)),
        inside = (KL_b <= clip_high or p <= p_old) if A > 0 else (KL_b <= clip_low or p >= p_old)
    i.e. only a move in the advantage's direction is bounded.
    """
    prob, old_prob = torch.exp(logp), torch.exp(old_logp)
    binary_kl = old_prob * (old_logp - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    inside = torch.where(advantages > 0, (binary_kl <= clip_high) | (prob <= old_prob),
                         (binary_kl <= clip_low) | (prob >= old_prob))
    return _dppo(old_logp, logp, advantages, response_mask, inside, clip_c, agg, token_weights, agg_counts)
