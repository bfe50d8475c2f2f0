"""Optimal Token Baseline (verl 0.9.1 `optimal_token_baseline` and `tir_optimal_token_baseline`): a baseline per
time step and prompt group instead of one per trajectory, each trajectory's return-to-go weighted by how much
gradient variance its path has accumulated so far.

With G_t = sum_{t' >= t} m r (reward-to-go), the per-token score-norm proxy
    w_t = 1 - 2 pi_t + sum_v pi_v^2,   pi_t = exp(old log-prob of the sampled token)
(times rho_t^2 with verl's rollout importance weights rho), and its running sum W_t = sum_{j <= t} m_j w_j:
    B_t = sum_{i in g} G_it W_it m_it / (sum_{i in g} W_it m_it + 1e-8),   A_it = (G_it - B_t) m_it
A group of one has B = 0. With ``handle_zero_tail`` (verl's default, which its trainer never changes) the
group's single longest trajectory gets B = 0 past the second longest one's length, where it has no partner
to share a baseline with. The plain estimator indexes t by column; the TIR (tool-interleaved, multi-turn)
one by the rank of the valid token in its row, so trajectories whose valid tokens sit in different columns
(tool output masked out in between) are compared token for token; there, rows with no valid token are
not part of any group.

Vectorized over the batch (group sums by `index_add_`), without gradient.
"""

from __future__ import annotations

import torch

from scalerl.algorithms.advantages import GroupIds, group_index

OTB_EPS = 1e-8  # verl's default; its trainer passes no epsilon to these estimators


def _step_weights(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights):
    """The cumulative path weight W [B, T] (verl's order of operations; not masked after the cumsum)."""
    mask = response_mask.to(old_log_probs.dtype)
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:  # scales W to minimise the MSE under truncated IS
        w = w * rollout_is_weights ** 2
    return (w * mask).cumsum(dim=-1)


def _zero_tail_start(lengths: torch.Tensor, codes: torch.Tensor, num_groups: int, in_group: torch.Tensor):
    """Per row: the position from which its baseline is zeroed (the second longest length of its group) where
    it is its group's one longest trajectory, else a position past the end. Rows not ``in_group`` are skipped."""
    never = torch.iinfo(torch.long).max
    lengths = lengths.to(torch.long)
    low = torch.full((num_groups,), -1, dtype=torch.long, device=lengths.device)
    member_lengths = torch.where(in_group, lengths, -1)
    top = low.scatter_reduce(0, codes, member_lengths, reduce="amax")
    is_top = in_group & (lengths == top[codes])
    top_count = torch.zeros(num_groups, dtype=torch.long, device=lengths.device).index_add_(0, codes, is_top.long())
    second = low.scatter_reduce(0, codes, torch.where(is_top, -1, member_lengths), reduce="amax")
    unique_top = is_top & (top_count[codes] == 1)
    return torch.where(unique_top, second[codes], never)


def _group_baseline(returns, weights, codes, num_groups, in_group):
    """sum_g G W / (sum_g W + eps) per group and step, broadcast to the rows; 0 for groups of one."""
    member = in_group.to(returns.dtype).unsqueeze(-1)
    zeros = torch.zeros((num_groups, returns.shape[-1]), dtype=returns.dtype, device=returns.device)
    numerator = zeros.index_add(0, codes, returns * weights * member)
    denominator = zeros.index_add(0, codes, weights * member) + OTB_EPS
    size = torch.zeros(num_groups, dtype=torch.long, device=codes.device).index_add_(0, codes, in_group.long())
    baseline = (numerator / denominator)[codes]
    return torch.where((size[codes] > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))


@torch.no_grad()
def optimal_token_baseline_advantages(token_rewards, response_mask, group_ids: GroupIds, old_log_probs,
                                      sum_pi_squared, rollout_is_weights=None,
                                      handle_zero_tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """verl `optimal_token_baseline`: B_t per column t (module docstring). Returns (A, G); G is not masked."""
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    weights = _step_weights(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights) * mask
    codes = group_index(group_ids, device=returns.device)
    num_groups = int(codes.max().item()) + 1 if codes.numel() else 0
    everyone = torch.ones_like(codes, dtype=torch.bool)
    baselines = _group_baseline(returns * mask, weights, codes, num_groups, everyone)
    if handle_zero_tail:
        start = _zero_tail_start(mask.sum(dim=-1), codes, num_groups, everyone)
        columns = torch.arange(returns.shape[-1], device=returns.device)
        baselines = baselines.masked_fill(columns[None, :] >= start[:, None], 0.0)
    return (returns - baselines) * mask, returns


@torch.no_grad()
def tir_optimal_token_baseline_advantages(token_rewards, response_mask, group_ids: GroupIds, old_log_probs,
                                          sum_pi_squared, rollout_is_weights=None,
                                          handle_zero_tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """verl `tir_optimal_token_baseline`: B per valid-token rank (the k-th valid token of each trajectory in
    the group share B_k), rows without valid tokens left out. Returns (A, G); G is not masked."""
    mask = response_mask.to(token_rewards.dtype)
    valid = response_mask.bool()
    returns = (token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    weights = _step_weights(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights)
    lengths = valid.sum(dim=-1)
    width = int(lengths.max().item()) if lengths.numel() else 0
    # each row's valid tokens packed to the left: position k holds the row's k-th valid token
    rank = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)
    rows = torch.arange(returns.shape[0], device=returns.device)[:, None].expand_as(rank)
    packed_returns = returns.new_zeros((returns.shape[0], width))
    packed_weights = weights.new_zeros((returns.shape[0], width))
    packed_returns[rows[valid], rank[valid]] = returns[valid]
    packed_weights[rows[valid], rank[valid]] = weights[valid]
    codes = group_index(group_ids, device=returns.device)
    num_groups = int(codes.max().item()) + 1 if codes.numel() else 0
    in_group = lengths > 0
    baselines = _group_baseline(packed_returns, packed_weights, codes, num_groups, in_group)
    if handle_zero_tail:
        start = _zero_tail_start(lengths, codes, num_groups, in_group)
        positions = torch.arange(width, device=returns.device)
        baselines = baselines.masked_fill(positions[None, :] >= start[:, None], 0.0)
    packed_advantages = packed_returns - baselines
    advantages = torch.zeros_like(returns)
    advantages[valid] = packed_advantages[rows[valid], rank[valid]]
    return advantages * mask, returns
