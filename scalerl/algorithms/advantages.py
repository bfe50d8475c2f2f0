"""Advantage estimators: group-relative (GRPO, Dr.GRPO), GAE for PPO with a value head, and the two
return-based ones without a critic (REINFORCE++, ReMax). The other group baselines (RLOO, OPO, GPG, ...)
are in `group_advantages`.

Each returns `(advantages, returns)` of shape [B, T] and is computed without gradient: advantages
are constants of the policy-gradient loss. Definitions match verl's `core_algos.py`
(`compute_grpo_outcome_advantage`, `compute_gae_advantage_return`,
`compute_reinforce_plus_plus_outcome_advantage`, `compute_remax_outcome_advantage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from scalerl.algorithms.masked import masked_whiten, sharded_masked_whiten

GroupIds = torch.Tensor | np.ndarray | Sequence[Any]


def group_index(group_ids: GroupIds, device: torch.device | str | None = None) -> torch.Tensor:
    """Map arbitrary hashable group ids to dense codes `0..G-1` (LongTensor [B]).

    Equal ids get equal codes. Accepts a tensor, a 1-D numpy array, or a list of hashables
    (ints, strings, uuids, tuples).
    """
    if isinstance(group_ids, torch.Tensor):
        return torch.unique(group_ids.flatten(), return_inverse=True)[1].to(device)
    array = np.asarray(group_ids) if not isinstance(group_ids, np.ndarray) else group_ids
    if array.ndim == 1 and array.dtype != object:
        # Vectorized path for numbers and strings.
        codes = np.unique(array, return_inverse=True)[1].reshape(-1)
    else:
        # Unorderable or composite ids (objects, tuples): fall back to a dict, one hash per sample.
        seen: dict[Any, int] = {}
        codes = np.fromiter((seen.setdefault(g, len(seen)) for g in group_ids), dtype=np.int64)
    return torch.as_tensor(codes, dtype=torch.long, device=device)


@torch.no_grad()
def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage (GRPO; Dr.GRPO when `norm_by_std=False`).

    For sequence i in group g with n_g members:
        s_i   = sum_t r_{i,t}                                  (outcome score)
        mu_g  = mean_{j in g} s_j,  sigma_g = std_{j in g} s_j  (unbiased, ddof = 1)
        A_i   = (s_i - mu_g) / (sigma_g + eps)   if norm_by_std  else  s_i - mu_g
    A group of one uses mu_g = 0 and sigma_g = 1 (its advantage is s_i / (1 + eps), as in verl).
    A_i is broadcast over the valid tokens: adv[i, t] = A_i * m_{i,t}. Returns (adv, adv).

    Statistics are gathered with `index_add_` over dense group codes, so there is no Python loop
    over the batch or the groups.
    """
    scores = token_rewards.sum(dim=-1)
    codes = group_index(group_ids, device=scores.device)
    if codes.numel() != scores.numel():
        raise ValueError(f"group_ids has {codes.numel()} entries for a batch of {scores.numel()}")
    num_groups = int(codes.max().item()) + 1 if codes.numel() else 0

    counts = torch.bincount(codes, minlength=num_groups).to(scores.dtype)
    group_mean = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, codes, scores)
    group_mean = group_mean / counts
    squared_dev = (scores - group_mean[codes]) ** 2
    group_var = torch.zeros_like(group_mean).index_add_(0, codes, squared_dev) / (counts - 1).clamp(min=1)
    group_std = group_var.sqrt()

    singleton = counts == 1
    group_mean = torch.where(singleton, torch.zeros_like(group_mean), group_mean)
    group_std = torch.where(singleton, torch.ones_like(group_std), group_std)

    centered = scores - group_mean[codes]
    advantage = centered / (group_std[codes] + eps) if norm_by_std else centered
    advantages = advantage.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    all_reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the response tokens, then whitening (verl / TRL).

    ``all_reduce`` (sum over data-parallel ranks) makes the whitening use the global batch's statistics
    when the batch is sharded; without it the statistics are this batch's.

    Backwards over t, with m_t the response mask (padding and observation tokens are skipped: they
    carry the running `next_value` and `gae` through unchanged):
        delta_t   = r_t + gamma * V_next - V_t
        gae_t     = m_t * (delta_t + gamma * lam * gae_{t+1}) + (1 - m_t) * gae_{t+1}
        V_next   <- m_t * V_t + (1 - m_t) * V_next
    returns = gae + V (before whitening); advantages = masked_whiten(gae, m) over all valid tokens
    of the batch: (gae - mean) / sqrt(var_unbiased + 1e-8).
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running_gae = torch.zeros_like(values[:, 0])
    gae_reversed = []
    for t in reversed(range(token_rewards.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step_gae = delta + gamma * lam * running_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running_gae = step_gae * mask[:, t] + (1 - mask[:, t]) * running_gae
        gae_reversed.append(running_gae)
    gae = torch.stack(gae_reversed[::-1], dim=1)
    returns = gae + values
    return whiten(gae, mask, all_reduce), returns


def whiten(values: torch.Tensor, mask: torch.Tensor, all_reduce=None) -> torch.Tensor:
    """`masked_whiten` over this batch, or over the global batch when ``all_reduce`` (SUM over DP) is given."""
    if all_reduce is not None:
        return sharded_masked_whiten(values, mask, all_reduce)
    return masked_whiten(values, mask)


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float, all_reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (verl `reinforce_plus_plus`): discounted returns, whitened over the batch's tokens.

    Backwards over t:  G_t = r_t + gamma * G_{t+1},  then G_{t+1} <- G_t * m_t  (reset after the response).
    advantages = masked_whiten(G, m) * m;  returns = G. ``all_reduce`` as in `gae_advantages`.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return whiten(returns, mask, all_reduce) * mask, returns


@torch.no_grad()
def remax_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (verl `remax`): reward-to-go minus the greedy response's reward b_i (shape [B]).

    returns[i, t] = sum_{s >= t} r_{i,s} m_{i,s};  advantages = returns - b_i * m. Returns (adv, returns).
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask, returns
