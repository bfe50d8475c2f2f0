"""Outcome advantages with a baseline from the other responses to the same prompt (group): RLOO, REINFORCE++
with a group baseline, OPO, GPG, GRPO for pass@k, GDPO, and verl's vectorized GRPO / RLOO variants.

Each scores a response by s_i = sum_t r_{i,t}, returns `(advantages, returns)` [B, T] with the scalar
advantage broadcast over the valid tokens, and runs without gradient and without a Python loop over the
batch (group sums by `index_add_`). A group is the set of samples sharing a group id; statistics are those
of this call's batch, so a trainer keeps every group on one rank. Definitions and edge cases (groups of
one) follow verl's `core_algos.py`; see docs/algorithms-formulas.md.
"""

from __future__ import annotations

import torch

from scalerl.algorithms.advantages import GroupIds, group_index, grpo_advantages, whiten


def _scores_and_groups(token_rewards: torch.Tensor, group_ids: GroupIds):
    scores = token_rewards.sum(dim=-1)
    codes = group_index(group_ids, device=scores.device)
    if codes.numel() != scores.numel():
        raise ValueError(f"group_ids has {codes.numel()} entries for a batch of {scores.numel()}")
    num_groups = int(codes.max().item()) + 1 if codes.numel() else 0
    return scores, codes, num_groups


def _group_sum(values: torch.Tensor, codes: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, codes, values)


def _group_mean(scores: torch.Tensor, codes: torch.Tensor, num_groups: int):
    """(mean per group, count per group); a group of one has mean 0, as in verl's loops."""
    counts = _group_sum(torch.ones_like(scores), codes, num_groups)
    mean = _group_sum(scores, codes, num_groups) / counts
    return torch.where(counts == 1, torch.zeros_like(mean), mean), counts


def _broadcast(advantage: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = advantage.unsqueeze(-1) * response_mask.to(advantage.dtype)
    return advantages, advantages


@torch.no_grad()
def rloo_advantages(token_rewards, response_mask, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (verl `rloo`): leave-one-out mean of the group as baseline.

    A_i = n/(n-1) * (s_i - mean_g) = s_i - mean_{j in g, j != i} s_j  for n > 1;  A_i = s_i for a group of one.
    """
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    mean, counts = _group_mean(scores, codes, num_groups)
    n = counts[codes]
    scale = n / (n - 1).clamp(min=1)
    advantage = torch.where(n > 1, scores * scale - mean[codes] * scale, scores)
    return _broadcast(advantage, response_mask)


@torch.no_grad()
def rloo_vectorized_advantages(token_rewards, response_mask, group_ids: GroupIds):
    """verl `rloo_vectorized`: (n s_i - sum_g s) / max(n - 1, 1), and 0 for a group of one (unlike `rloo`)."""
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    counts = _group_sum(torch.ones_like(scores), codes, num_groups)[codes]
    sums = _group_sum(scores, codes, num_groups)[codes]
    advantage = ((counts * scores - sums) / (counts - 1).clamp_min(1)) * (counts > 1)
    return _broadcast(advantage, response_mask)


@torch.no_grad()
def grpo_vectorized_advantages(token_rewards, response_mask, group_ids: GroupIds, norm_by_std: bool = True,
                               eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """verl `grpo_vectorized`: GRPO with verl's vectorized statistics, which differ from `grpo` in two ways:
    float32 sums (var = (sum s^2 - (sum s)^2 / n) / max(n - 1, 1)) and a variance floor,
    sigma_g = sqrt(max(var, eps)). A group of one has mean 0 and sigma 1.
    """
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    scores32 = scores.to(torch.float32)
    counts = _group_sum(torch.ones_like(scores32), codes, num_groups)
    s1 = _group_sum(scores32, codes, num_groups)
    s2 = _group_sum(scores32 * scores32, codes, num_groups)
    mean = s1 / counts.clamp_min(1.0)
    var = (s2 - (s1 * s1) / counts.clamp_min(1.0)) / (counts - 1.0).clamp_min(1.0)
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = counts <= 1.0
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centered = scores - mean[codes]
    advantage = centered / (std[codes] + eps) if norm_by_std else centered
    return _broadcast(advantage, response_mask)


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(token_rewards, response_mask, group_ids: GroupIds, all_reduce=None):
    """REINFORCE++-baseline (verl `reinforce_plus_plus_baseline`): subtract the group mean (0 for a group of
    one), broadcast over the tokens, then whiten over all valid tokens of the batch:
    A = masked_whiten((s_i - mean_g) * m, m) * m. ``all_reduce`` whitens with the global batch's statistics.
    """
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    mean, _ = _group_mean(scores, codes, num_groups)
    mask = response_mask.to(scores.dtype)
    centered = (scores - mean[codes]).unsqueeze(-1).tile([1, token_rewards.shape[-1]]) * mask
    advantages = whiten(centered, mask, all_reduce) * mask
    return advantages, advantages


@torch.no_grad()
def opo_advantages(token_rewards, response_mask, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (verl `opo`): length-weighted group mean as baseline, b_g = sum_j |y_j| s_j / sum_j |y_j|,
    A_i = s_i - b_g  (b = 0 for a group of one), |y| the number of valid tokens."""
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    counts = _group_sum(torch.ones_like(scores), codes, num_groups)
    baseline = _group_sum(lengths * scores, codes, num_groups) / _group_sum(lengths, codes, num_groups)
    baseline = torch.where(counts == 1, torch.zeros_like(baseline), baseline)
    return _broadcast(scores - baseline[codes], response_mask)


@torch.no_grad()
def gpg_advantages(token_rewards, response_mask, group_ids: GroupIds, f_norm: float = 1.0,
                   all_reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (verl `gpg`): A_i = alpha (s_i - mean_g) / f_norm, alpha = B / max(M, 1), M = the number of
    responses with a non-zero score (mean 0 for a group of one). With ``all_reduce`` B and M are the global
    batch's (verl computes them over the whole batch on the driver)."""
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    counts = torch.tensor([scores.shape[0], torch.count_nonzero(scores).item()], dtype=scores.dtype,
                          device=scores.device)
    if all_reduce is not None:
        counts = all_reduce(counts)
    alpha = counts[0] / counts[1].clamp(min=1)
    mean, _ = _group_mean(scores, codes, num_groups)
    return _broadcast(alpha * (scores - mean[codes]) / f_norm, response_mask)


@torch.no_grad()
def grpo_passk_advantages(token_rewards, response_mask, group_ids: GroupIds, norm_by_std: bool = True,
                          eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (verl `grpo_passk`, arXiv 2503.19595): only the best response of each group gets an
    advantage, A = (s_max - s_second) / (sigma_g + eps) (sigma_g unbiased; no division without
    norm_by_std); every other response gets 0. Needs at least two responses per group. With a tie at the
    top the advantage is 0, so which of the tied responses is "the best" does not matter.
    """
    scores, codes, num_groups = _scores_and_groups(token_rewards, group_ids)
    counts = _group_sum(torch.ones_like(scores), codes, num_groups)
    if bool((counts < 2).any()):
        raise ValueError(f"grpo_passk needs at least 2 samples per group; the smallest group has "
                         f"{int(counts.min().item())}")
    neg_inf = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    top = neg_inf.scatter_reduce(0, codes, scores, reduce="amax")
    is_top = scores == top[codes]
    ties_at_top = _group_sum(is_top.to(scores.dtype), codes, num_groups)
    below_top = neg_inf.scatter_reduce(0, codes, torch.where(is_top, neg_inf[codes], scores), reduce="amax")
    second = torch.where(ties_at_top >= 2, top, below_top)
    gap = top - second
    if norm_by_std:
        mean = _group_sum(scores, codes, num_groups) / counts
        std = (_group_sum((scores - mean[codes]) ** 2, codes, num_groups) / (counts - 1)).sqrt()
        gap = gap / (std + eps)
    # the first top-scoring member of each group carries the gap
    position = torch.arange(scores.shape[0], device=scores.device)
    first_top = torch.full((num_groups,), scores.shape[0], dtype=torch.long, device=scores.device)
    first_top = first_top.scatter_reduce(0, codes, torch.where(is_top, position, scores.shape[0]), reduce="amin")
    advantage = torch.where(position == first_top[codes], gap[codes], torch.zeros_like(scores))
    return _broadcast(advantage, response_mask)


@torch.no_grad()
def gdpo_advantages(reward_components: torch.Tensor, response_mask, group_ids: GroupIds,
                    reward_weights=None, norm_by_std: bool = True, eps: float = 1e-6,
                    all_reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (verl 0.9.1 `gdpo`, arXiv 2601.05242): GRPO on each reward component separately, so that a
    component with a large spread does not drown the others, then a weighted sum whitened over the batch:
        A_k = grpo(s_k)  (per group, as `grpo_advantages`),  A = masked_whiten(sum_k w_k A_k, m) * m
    ``reward_components`` [K, B]: each component's score per sample (verl reads them from the reward
    function's dict under ``algorithm.gdpo_reward_keys``, in float32); ``reward_weights`` [K] default to 1
    (verl's ``algorithm.gdpo_reward_weights``). ``all_reduce`` whitens with the global batch's statistics.
    """
    components = torch.as_tensor(reward_components, device=response_mask.device).to(torch.float32)
    if components.dim() != 2 or components.shape[1] != response_mask.shape[0]:
        raise ValueError(f"gdpo needs reward_components of shape [K, {response_mask.shape[0]}] "
                         f"(one score per component and sample), got {tuple(components.shape)}")
    weights = torch.ones(components.shape[0], dtype=torch.float32, device=components.device) \
        if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float32, device=components.device)
    if weights.shape != (components.shape[0],):
        raise ValueError(f"gdpo has {components.shape[0]} reward components but {weights.numel()} reward_weights")
    total = None
    for weight, scores in zip(weights, components):
        # verl places each component's score on the last response token; only its sum over the row is read
        advantage, _ = grpo_advantages(scores.unsqueeze(-1), response_mask, group_ids, norm_by_std, eps)
        total = weight * advantage if total is None else total + weight * advantage
    mask = response_mask.to(total.dtype)
    advantages = whiten(total, mask, all_reduce) * mask
    return advantages, advantages
