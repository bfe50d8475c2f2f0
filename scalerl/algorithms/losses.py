"""PPO losses over [B, T] token matrices and the one place that reduces them to a scalar.

Definitions match verl's `core_algos.py`: `agg_loss`, `compute_policy_loss_vanilla` (dual-clip
PPO) and `compute_value_loss`.

How a trainer calls these so that data parallelism and gradient accumulation do not change the
result (the sum over micro-batches, averaged over DP ranks, equals the full-batch aggregate):

    # once per optimizer step, over every micro-batch of this rank, then all-reduced (SUM) over DP:
    global_num_tokens = all_reduce_sum(sum(mb.mask.sum() for mb in micro_batches))
    global_num_seqs   = all_reduce_sum(sum((mb.mask.sum(-1) > 0).sum() for mb in micro_batches))
    for mb in micro_batches:
        loss, metrics = policy_loss(..., agg=mode, global_num_tokens=global_num_tokens,
                                    global_num_seqs=global_num_seqs, dp_size=dp_world_size,
                                    horizon=max_response_length)
        loss.backward()            # no division by the number of micro-batches
    optimizer.step()               # DDP / FSDP average gradients over the dp_world_size ranks

`dp_size` is the number of ranks whose gradients are *averaged*; pass 1 when gradients are summed.
`horizon` (seq-mean-token-sum-norm) must be the same constant on every micro-batch, e.g. the
configured max response length, since micro-batches may be padded to different lengths.
"""

from __future__ import annotations

import torch

from scalerl.algorithms.masked import COUNT_EPS, masked_mean, masked_sum

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# log-ratio clamp before exp: keeps the ratio finite when the policy moved far from the sampler.
LOG_RATIO_CLAMP = 20.0


def _denominator(global_count: int | float | torch.Tensor | None, local_count: torch.Tensor, dp_size: int,
                 name: str) -> torch.Tensor | int | float:
    if global_count is None:
        if dp_size > 1:
            raise ValueError(f"{name} (over all ranks and micro-batches) is required when dp_size > 1")
        global_count = local_count
    # A count of zero only occurs when the numerator is zero too: give 0, not NaN.
    if isinstance(global_count, torch.Tensor):
        return global_count.clamp(min=1)
    return max(global_count, 1)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_num_tokens: int | torch.Tensor | None = None,
    global_num_seqs: int | torch.Tensor | None = None,
    dp_size: int = 1,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] loss matrix to a scalar over valid tokens m (verl's `agg_loss`).

    With N = global_num_tokens (default: sum m of this call), S = global_num_seqs (default: rows of
    this call with any valid token), D = dp_size, L_i = sum_t m_it l_it, n_i = sum_t m_it:
        token-mean               D * sum_it m_it l_it / N
        token-sum                D * sum_it m_it l_it
        seq-mean-token-sum       D * sum_{i: n_i>0} L_i / S
        seq-mean-token-mean      D * sum_{i: n_i>0} (L_i / (n_i + 1e-8)) / S
        seq-mean-token-sum-norm  D * sum_{i: n_i>0} L_i / S / H,   H = horizon (default T)
    With the defaults (D = 1) each mode is the plain full-batch value; see the module docstring
    for the call that makes micro-batches and ranks add up to it.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        num_tokens = _denominator(global_num_tokens, mask.sum(), dp_size, "global_num_tokens")
        return masked_sum(loss_mat, mask) / num_tokens * dp_size
    if mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    tokens_per_seq = mask.sum(dim=-1)
    seq_has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        seq_losses = masked_sum(loss_mat, mask, dim=-1) / (tokens_per_seq + COUNT_EPS)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")
    num_seqs = _denominator(global_num_seqs, seq_has_tokens.sum(), dp_size, "global_num_seqs")
    loss = masked_sum(seq_losses, seq_has_tokens) / num_seqs * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (horizon if horizon is not None else mask.shape[-1])
    return loss


def policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
    *,
    global_num_tokens: int | torch.Tensor | None = None,
    global_num_seqs: int | torch.Tensor | None = None,
    dp_size: int = 1,
    horizon: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO policy loss (verl `compute_policy_loss_vanilla`).

    Per token, with r = exp(clamp(logp - old_logp, -20, 20)) and advantage A:
        l_clip = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        l      = min(l_clip, -A clip_c)   if A < 0   (dual clip: bounds the loss of a huge ratio)
                 l_clip                   otherwise
    loss = aggregate_loss(l, mask, agg, ...). Metrics (detached scalars, masked means):
        pg_clipfrac        fraction where the clipped term is larger: -A clip(r) > -A r
        ppo_kl             mean of (old_logp - logp) after the clamp (approx. KL(old || new))
        pg_clipfrac_lower  fraction with A < 0 and l_clip > -A clip_c (dual clip active)
    ``token_weights`` (detached), when given, multiply l per token before aggregation: the truncated
    importance weights min(exp(old_logp - rollout_logp), cap) of verl's TIS, when the rollout was sampled
    by other weights or other numerics than ``old_logp``'s.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c (dual-clip lower bound of the ratio) must be > 1, got {clip_c}")
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * clip_c
    negative = advantages < 0
    token_losses = torch.where(negative, torch.minimum(clip_loss, dual_clip_bound), clip_loss)
    if token_weights is not None:
        token_losses = token_losses * token_weights

    loss = aggregate_loss(token_losses, response_mask, agg, global_num_tokens=global_num_tokens,
                          global_num_seqs=global_num_seqs, dp_size=dp_size, horizon=horizon)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean(((clip_loss > dual_clip_bound) & negative).to(logp.dtype),
                                             response_mask),
        }
    return loss, metrics


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    agg: str = "token-mean",
    *,
    global_num_tokens: int | torch.Tensor | None = None,
    global_num_seqs: int | torch.Tensor | None = None,
    dp_size: int = 1,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss (verl `compute_value_loss`).

    With V the old values and R the returns, per token:
        V_clip = clamp(vpred, V - cliprange_value, V + cliprange_value)
        l      = max((vpred - R)^2, (V_clip - R)^2)
    loss = 0.5 * aggregate_loss(l, mask, agg, ...). Metric: vf_clipfrac = masked mean of
    [(V_clip - R)^2 > (vpred - R)^2] (detached).
    """
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), response_mask, agg,
                                global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                                dp_size=dp_size, horizon=horizon)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped > unclipped).to(vpreds.dtype), response_mask)}
    return loss, metrics
