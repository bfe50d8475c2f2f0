"""Reference definitions from verl, used only by the tests to check scalerl.algorithms numerically.

Attribution: the algorithms below are those of volcengine/verl (Apache-2.0),
`verl/trainer/ppo/core_algos.py` (the advantage estimators compute_*_advantage[_return], agg_loss, the
policy losses compute_policy_loss_{vanilla,gspo,sapo,gpg,clip_cov,kl_cov,geo_mean,cispo,dppo_tv,dppo_kl},
compute_value_loss, kl_penalty / kl_penalty_forward, AdaptiveKLController / FixedKLController),
`verl/utils/torch_functional.py` (masked_sum/mean/var/whiten, entropy_from_logits,
logprobs_from_logits_naive), `verl/utils/groupwise.py` (group_mean_std), `verl/trainer/ppo/ray_trainer.py`
(apply_kl_penalty), `verl/workers/reward_manager/dapo.py` (the overlong buffer), `recipe/dapo`'s
dapo_ray_trainer.py (the dynamic-sampling group filter) and `verl/trainer/ppo/metric_utils.py`
(calc_maj_val). They are restated here step for step, in verl's own order of operations (per-sample
Python loops and dicts included), with verl's config objects and DataProto replaced by plain arguments,
and verl's `.item()` metric floats kept.

Versions followed: verl commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29, version 0.8.0.dev)
for everything except: agg_loss with global batch info raising without it when dp_size > 1, its
"seq-mean-token-sum-norm" divided by the global batch size, and the "token-sum" mode (later verl, v0.9);
compute_policy_loss_dppo_tv / _dppo_kl (arXiv 2602.04879), which entered verl after that commit and were
read from later copies of core_algos.py; and kl_penalty stripping the trailing '+' before dispatch.
Where verl ignores `loss_agg_mode` (gspo and sapo pin "seq-mean-token-mean", geo_mean takes a plain mean
over rows) the transcription keeps verl's behaviour by default; `pinned_agg_mode` / `verl_mean=False`
are the tests' hooks for scalerl's extension to every mode, not verl code.

verl 0.9.1 (the `verl-0.9.1-py3-none-any.whl` release, `verl/trainer/ppo/core_algos.py` and
`verl/trainer/ppo/rollout_corr_helper.py`), marked "0.9.1" below: compute_policy_loss_sapo (always
"seq-mean-token-mean") and compute_policy_loss_geo_mean (torch.mean over rows), re-read against 0.9.1; and
the section at the end: compute_gdpo_outcome_advantage, compute_optimal_token_baseline_advantage,
compute_multi_turn_optimal_token_baseline_advantage, compute_policy_loss_dro, compute_policy_loss_reinforce,
compute_policy_loss_bypass_mode with the weight and mask parts of compute_rollout_correction_weights /
compute_rollout_rejection_mask / compute_rollout_correction_and_rejection_mask (their rollout_corr/* metrics
left out: scalerl does not log them from the loss). 0.9.1's gspo honours loss_agg_mode (its transcription
above pins it by default; the tests release the pin).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

# --- verl/utils/torch_functional.py ---------------------------------------------------------


def masked_sum(values, mask, axis=None):
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        assert n > 1
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out += mean
    return out


def entropy_from_logits(logits):
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def logprobs_from_logits_naive(logits, labels):
    logp = torch.nn.functional.log_softmax(logits, dim=-1)
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)


# --- verl/trainer/ppo/core_algos.py ----------------------------------------------------------


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    members = defaultdict(list)
    group_mean, group_std = {}, {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            members[index[i]].append(scores[i])
        for gid, group in members.items():
            if len(group) == 1:
                group_mean[gid], group_std[gid] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(group)
                group_mean[gid], group_std[gid] = torch.mean(stacked), torch.std(stacked)
        for i in range(scores.shape[0]):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - group_mean[index[i]]) / (group_std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - group_mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        nextvalues, lastgaelam, reversed_adv = 0, 0, []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            step = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = step * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
            reversed_adv.append(lastgaelam)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            assert dp_size == 1
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            assert dp_size == 1
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        counts = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (counts + 1e-8)
        seq_mask = (counts > 0).float()
        if global_batch_size is None:
            assert dp_size == 1
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(loss_agg_mode)


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, rollout_is_weights=None,
                                **global_batch_info):
    # returns verl's four values (older API) rather than its metrics dict; the math is that of b178a3cd
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean"):
    # verl_F.clip_by_value(x, lo, hi) = max(min(x, hi), lo)
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        kld = (torch.exp(kl) - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def kl_penalty(logprob, ref_logprob, kl_penalty):
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward_score = kl_penalty_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


# --- verl/utils/groupwise.py -------------------------------------------------------------------


def group_mean_std(scores, gidx, eps=1e-6):
    scores = scores.reshape(-1).to(dtype=torch.float32)
    gidx = gidx.reshape(-1).to(dtype=torch.long)
    G = int(torch.max(gidx).item()) + 1
    ones = torch.ones_like(scores, dtype=torch.float32)
    count = torch.zeros(G, dtype=torch.float32).index_add_(0, gidx, ones)
    s1 = torch.zeros(G, dtype=torch.float32).index_add_(0, gidx, scores)
    s2 = torch.zeros(G, dtype=torch.float32).index_add_(0, gidx, scores * scores)
    mean = s1 / count.clamp_min(1.0)
    var_num = s2 - (s1 * s1) / count.clamp_min(1.0)
    denom = (count - 1.0).clamp_min(1.0)
    var = var_num / denom
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = count <= 1.0
    if torch.any(single):
        mean = mean.clone()
        std = std.clone()
        mean[single] = 0.0
        std[single] = 1.0
    return mean, std, count


# --- verl/trainer/ppo/core_algos.py: the other advantage estimators ----------------------------


def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              norm_adv_by_std_in_grpo=True):
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g = torch.from_numpy(np.asarray(index).astype(np.int64))  # as_torch_index on integer labels
        mean_g, std_g, _ = group_mean_std(scores, g, eps=epsilon)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean_g[g]) / (std_g[g] + epsilon)
        else:
            scalars = scores - mean_g[g]
        advantages = scalars.unsqueeze(-1) * response_mask
        return advantages, advantages


def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores = defaultdict(list)
    id2indices = defaultdict(list)
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            idx = index[i]
            id2scores[idx].append(scores[i])
            id2indices[idx].append(i)
        for idx in id2scores:
            rewards = torch.stack(id2scores[idx])
            if rewards.numel() < 2:
                raise ValueError(f"Pass@k requires at least 2 samples per group. Got {rewards.numel()}")
            topk, topk_idx = torch.topk(rewards, 2)
            r_max, r_second_max = topk[0], topk[1]
            i_max = id2indices[idx][topk_idx[0].item()]
            advantage = r_max - r_second_max
            if norm_adv_by_std_in_grpo:
                std = torch.std(rewards)
                advantage = advantage / (std + epsilon)
            advantages[i_max] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           epsilon=1e-6):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[index[i]] * response_num / (
                    response_num - 1
                )
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        inv = torch.from_numpy(np.unique(index, return_inverse=True)[1]).to(scores.device)
        c = torch.bincount(inv)[inv].to(scores.dtype)
        adv = ((c * scores - torch.bincount(inv, weights=scores)[inv]) / (c - 1).clamp_min(1)) * (c > 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2len = defaultdict(list)
    id2bsl = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
            id2len[index[i]].append(response_length[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2bsl[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                score_tensor = torch.stack(id2score[idx])
                len_tensor = torch.stack(id2len[idx])
                id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
        for i in range(bsz):
            scores[i] = scores[i] - id2bsl[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = running_return
            running_return = running_return * response_mask[:, t]
        advantages = masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0):
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        m = torch.count_nonzero(scores)
        alpha = bsz / m.clamp(min=1)
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            scores[i] = alpha * (scores[i] - id2mean[index[i]]) / (f_norm)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# --- verl/trainer/ppo/core_algos.py: the other policy losses -----------------------------------
# `clip_low` / `clip_high` stand for config.clip_ratio_low / _high (already resolved against clip_ratio);
# `global_batch_info` for config.global_batch_info (agg_loss's dp_size, batch_num_tokens, ...).


def _metrics(**values):
    return {f"actor/{k}": v.detach().item() for k, v in values.items()}


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             clip_low=0.2, clip_high=0.2, rollout_is_weights=None,
                             pinned_agg_mode="seq-mean-token-mean", **global_batch_info):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, pinned_agg_mode or loss_agg_mode, **global_batch_info)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_clipfrac_lower = torch.tensor(0.0)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


# 0.9.1: agg_loss(..., loss_agg_mode="seq-mean-token-mean", ...) whatever loss_agg_mode says
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None,
                             pinned_agg_mode="seq-mean-token-mean", **global_batch_info):
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(condition=advantages > 0, input=tau_pos, other=tau_neg)
    gates = gate_function(ratio, taus)
    pg_losses = -gates * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, pinned_agg_mode or loss_agg_mode, **global_batch_info)
    pg_clipfrac = torch.tensor(0.0)
    pg_clipfrac_lower = torch.tensor(0.0)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            rollout_is_weights=None, **global_batch_info):
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {}


def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 clip_low=0.2, clip_high=0.2, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
                                 rollout_is_weights=None, **global_batch_info):
    assert clip_cov_ratio > 0, "clip_ratio should be larger than 0."
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl)


def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               kl_cov_ratio=0.0002, ppo_kl_coef=1.0, rollout_is_weights=None, **global_batch_info):
    assert kl_cov_ratio > 0, "kl_cov_ratio should be larger than 0."
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = pg_losses_kl[
                large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            ]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, _metrics(ppo_kl=ppo_kl_abs)


# 0.9.1: pg_loss = torch.mean(pg_losses) whatever loss_agg_mode says ("not used")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 clip_low=0.2, clip_high=0.2, rollout_is_weights=None, verl_mean=True,
                                 **global_batch_info):
    cliprange_low, cliprange_high = clip_low, clip_high
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    if verl_mean:
        pg_loss = torch.mean(pg_losses)
    else:  # scalerl's extension: each row's loss on its tokens, reduced by agg_loss
        pg_loss = agg_loss(pg_losses.unsqueeze(-1).expand_as(response_mask), response_mask, loss_agg_mode,
                           **global_batch_info)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              clip_low=0.2, clip_high=0.2, rollout_is_weights=None, **global_batch_info):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    pg_clipfrac_lower = torch.tensor(0.0)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                clip_low=0.2, clip_high=0.2, clip_ratio_c=20.0, rollout_is_weights=None,
                                **global_batch_info):
    clip_divergence_low, clip_divergence_high = clip_low, clip_high
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c)
    truncated_ratio = truncated_ratio.detach()
    prob = torch.exp(log_prob)
    old_prob = torch.exp(old_log_prob)
    valid_positive_mask = (prob - old_prob) <= clip_divergence_high
    valid_negative_mask = (prob - old_prob) >= -clip_divergence_low
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask)
    valid_mask = valid_mask.detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    pg_clipfrac = masked_mean((1.0 - valid_mask).float(), response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).float() * valid_mask, response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                clip_low=0.2, clip_high=0.2, clip_ratio_c=20.0, rollout_is_weights=None,
                                **global_batch_info):
    clip_divergence_low, clip_divergence_high = clip_low, clip_high
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c)
    truncated_ratio = truncated_ratio.detach()
    prob = torch.exp(log_prob)
    old_prob = torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    valid_positive_mask = (binary_kl <= clip_divergence_high) | (prob <= old_prob)
    valid_negative_mask = (binary_kl <= clip_divergence_low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask)
    valid_mask = valid_mask.detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    pg_clipfrac = masked_mean((1.0 - valid_mask).float(), response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).float() * valid_mask, response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


# --- KL in the reward: core_algos.py controllers, ray_trainer.py apply_kl_penalty ---------------


class AdaptiveKLController:
    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl, n_steps):
        target = self.target
        proportional_error = np.clip(current_kl / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult


class FixedKLController:
    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current_kl, n_steps):
        pass


def apply_kl_penalty(token_level_scores, old_log_probs, ref_log_prob, response_mask, kl_ctrl, kl_penalty_kind="kl"):
    batch_size = token_level_scores.shape[0]
    kld = kl_penalty(old_log_probs, ref_log_prob, kl_penalty_kind)
    kld = kld * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, mask=response_mask, axis=-1)
    current_kl = torch.mean(current_kl, dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=batch_size)
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# --- DAPO: reward_manager/dapo.py overlong buffer, recipe/dapo group filter; metric_utils maj ---


def overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


def dapo_kept_prompt_uids(uids, metric_values):
    prompt_uid2metric_vals = defaultdict(list)
    for uid, metric_val in zip(uids, metric_values, strict=True):
        prompt_uid2metric_vals[uid].append(metric_val)
    prompt_uid2metric_std = {}
    for prompt_uid, metric_vals in prompt_uid2metric_vals.items():
        prompt_uid2metric_std[prompt_uid] = np.std(metric_vals)
    kept_prompt_uids = [
        uid for uid, std in prompt_uid2metric_std.items() if std > 0 or len(prompt_uid2metric_vals[uid]) == 1
    ]
    return kept_prompt_uids


def calc_maj_val(data, vote_key, val_key):
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d[vote_key]].append(d[val_key])
    vote2cnt = {k: len(v) for k, v in vote2vals.items()}
    maj_vote = max(vote2cnt, key=vote2cnt.get)
    maj_val = vote2vals[maj_vote][0]
    return maj_val


# --- verl 0.9.1: core_algos.py (gdpo, optimal token baselines, dro, bypass_mode), rollout_corr_helper.py ----


def compute_gdpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, gdpo_reward_keys=None, gdpo_reward_weights=None,
                                   non_tensor_batch=None, response_attention_mask=None):
    # verl's config / batch stand-ins: gdpo_reward_keys, gdpo_reward_weights, non_tensor_batch (key -> scores)
    # and the response part of batch["attention_mask"]
    score_list = None
    reward_weights = None
    if non_tensor_batch is not None:
        assert gdpo_reward_keys
        valid_response_length = response_attention_mask.sum(dim=1) - 1
        score_list = []
        for key in gdpo_reward_keys:
            assert key in non_tensor_batch
            comp = non_tensor_batch[key]
            rm_score = torch.tensor(np.asarray(comp, dtype=np.float32))
            rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
            rm_scores[torch.arange(rm_scores.size(0)), valid_response_length.long()] = rm_score
            score_list.append(rm_scores)
        if gdpo_reward_weights is not None:
            reward_weights = list(gdpo_reward_weights)
    if score_list is None:
        score_list = [token_level_rewards]
    num_scores = len(score_list)
    if reward_weights is not None:
        weights = torch.tensor(reward_weights, dtype=torch.float32)
    else:
        weights = torch.ones(num_scores, dtype=torch.float32)
    new_advantage = None
    for i in range(num_scores):
        normalized_score, _ = compute_grpo_outcome_advantage(
            score_list[i], response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        if new_advantage is None:
            new_advantage = weights[i] * normalized_score
        else:
            new_advantage += weights[i] * normalized_score
    advantages = masked_whiten(new_advantage, response_mask) * response_mask
    return advantages, advantages


def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                             sum_pi_squared, rollout_is_weights=None, handle_zero_tail=True,
                                             epsilon=1e-8):
    with torch.no_grad():
        batch_size = token_level_rewards.shape[0]
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        pi_t = torch.exp(old_log_probs)
        w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
        if rollout_is_weights is not None:
            w_per_timestep = w_per_timestep * (rollout_is_weights**2)
        w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
        prompt_groups = defaultdict(list)
        for i in range(batch_size):
            prompt_groups[index[i]].append(i)
        baselines = torch.zeros_like(returns)
        for trajectory_indices in prompt_groups.values():
            N = len(trajectory_indices)
            if N == 1:
                continue
            traj_idx = torch.tensor(trajectory_indices)
            returns_group = returns[traj_idx]
            w_cumulative_group = w_cumulative[traj_idx]
            mask_group = response_mask[traj_idx]
            numerator = (returns_group * w_cumulative_group * mask_group).sum(dim=0)
            denominator = (w_cumulative_group * mask_group).sum(dim=0) + epsilon
            baseline_per_step = numerator / denominator
            baselines[traj_idx] = baseline_per_step.unsqueeze(0).expand(N, -1)
            if handle_zero_tail:
                response_lengths = mask_group.sum(dim=-1)
                sorted_lengths, _ = torch.sort(response_lengths)
                max_length = int(sorted_lengths[-1].item())
                second_max_length = int(sorted_lengths[-2].item())
                max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
                if max_length_idx.numel() == 1 and max_length > second_max_length:
                    max_length_traj_idx = trajectory_indices[int(max_length_idx[0])]
                    baselines[max_length_traj_idx, second_max_length:] = 0.0
        advantages = (returns - baselines) * response_mask
    return advantages, returns


def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                                        sum_pi_squared, rollout_is_weights=None,
                                                        handle_zero_tail=True, epsilon=1e-8):
    with torch.no_grad():
        token_returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        pi_t = torch.exp(old_log_probs)
        w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
        if rollout_is_weights is not None:
            w_per_timestep = w_per_timestep * (rollout_is_weights**2)
        w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
        response_lengths = response_mask.sum(dim=-1).to(dtype=torch.long)
        max_response_length = int(response_lengths.max().item()) if response_lengths.numel() > 0 else 0
        all_w_values = w_cumulative.new_zeros((len(response_lengths), max_response_length))
        all_returns = torch.zeros_like(all_w_values)
        for i in range(len(response_lengths)):
            length = int(response_lengths[i].item())
            if length == 0:
                continue
            mask = response_mask[i].bool()
            all_w_values[i, :length] = w_cumulative[i, mask]
            all_returns[i, :length] = token_returns[i, mask]
        prompt_groups = defaultdict(list)
        for i in range(len(response_lengths)):
            if response_lengths[i] == 0:
                continue
            prompt_groups[index[i]].append(i)
        baselines = torch.zeros_like(all_returns)
        for trajectory_indices in prompt_groups.values():
            N = len(trajectory_indices)
            traj_idx = torch.tensor(trajectory_indices)
            if N == 1:
                baselines[traj_idx[0]] = 0.0
                continue
            w_group = all_w_values[traj_idx]
            R_group = all_returns[traj_idx]
            b_star = (R_group * w_group).sum(dim=0) / (w_group.sum(dim=0) + epsilon)
            baselines[traj_idx] = b_star.to(baselines.dtype)
            if handle_zero_tail:
                response_lengths_group = response_lengths[traj_idx]
                sorted_lengths, _ = torch.sort(response_lengths_group)
                max_length = int(sorted_lengths[-1].item())
                second_max_length = int(sorted_lengths[-2].item())
                max_length_idx = (response_lengths_group == max_length).nonzero(as_tuple=True)[0]
                if max_length_idx.numel() == 1 and max_length > second_max_length:
                    max_length_traj_idx = trajectory_indices[int(max_length_idx[0])]
                    baselines[max_length_traj_idx, second_max_length:] = 0.0
        all_advantages = all_returns - baselines
        advantages = torch.zeros_like(token_returns)
        for i in range(len(response_lengths)):
            if response_lengths[i] == 0:
                continue
            advantages[i, response_mask[i].bool()] = all_advantages[i, : response_lengths[i]]
        advantages = advantages * response_mask
    return advantages, token_returns


def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            dro_beta=None, rollout_is_weights=None, **global_batch_info):
    beta = dro_beta
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    pg_metrics = {"actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach().item()}
    return pg_loss, pg_metrics


SAFETY_BOUND = 20.0
SUPPORTED_ROLLOUT_RS_OPTIONS = {"token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                                "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"}
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS = {"token_k1", "token_k2", "token_k3"}


def _parse_rollout_is_threshold(threshold_spec):
    if isinstance(threshold_spec, bool):
        raise TypeError("rollout_is_threshold must be a float or a string, not a boolean.")
    if isinstance(threshold_spec, int | float):
        upper = float(threshold_spec)
        lower = None
    else:
        spec = threshold_spec.strip()
        if "_" in spec:
            lower_str, upper_str = spec.split("_", 1)
            lower = float(lower_str)
            upper = float(upper_str)
        else:
            upper = float(spec)
            lower = None
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}.")
    if lower is not None:
        if lower <= 0:
            raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}.")
        if lower > upper:
            raise ValueError("rollout_is_threshold lower bound must be <= upper bound.")
    return upper, lower


def _parse_rollout_rs_thresholds(options, threshold_spec):
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(threshold_spec, int | float):
        raw_specs = [str(threshold_spec)]
    else:
        raw_specs = [part.strip() for part in threshold_spec.split(",") if part.strip()]
    if len(raw_specs) not in (1, len(options)):
        raise ValueError("rollout_rs_threshold expects one threshold or one per option.")
    if len(raw_specs) == 1 and len(options) > 1:
        raw_specs = raw_specs * len(options)
    thresholds = {}
    for option, spec in zip(options, raw_specs, strict=False):
        if option.endswith("k1"):
            if "_" in spec:
                lower_str, upper_str = spec.split("_", 1)
            else:
                upper_str = spec
                lower_str = str(1.0 / float(upper_str))
            lower = float(lower_str)
            upper = float(upper_str)
            if lower <= 0 or upper <= 0:
                raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
            if lower > upper:
                raise ValueError(f"Thresholds for option '{option}' must be lower <= upper, got {spec}.")
            thresholds[option] = {"lower": lower, "upper": upper}
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold for option '{option}' must provide a single upper bound.")
            upper = float(spec)
            if upper <= 0:
                raise ValueError(f"Threshold for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {"lower": None, "upper": upper}
    return thresholds


def compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs="token_k1", rollout_rs_threshold=None):
    if log_ratio.shape[0] == 0:
        return response_mask
    option_modes = [opt.strip() for opt in rollout_rs.split(",") if opt.strip()]
    normalized_options, seen = [], set()
    for opt in option_modes:
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {opt}.")
        if opt not in seen:
            normalized_options.append(opt)
            seen.add(opt)
    threshold_specs = _parse_rollout_rs_thresholds(normalized_options, rollout_rs_threshold)
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token_k1 = -log_ratio_safe
    token_k2 = 0.5 * log_ratio_safe**2
    token_k3 = torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe
    response_mask_bool = response_mask.bool()
    combined_mask = torch.ones_like(response_mask, dtype=log_ratio.dtype)

    def _sequence_sum(values):
        return masked_sum(values, response_mask, axis=-1)

    def _sequence_mean(values):
        return masked_mean(values, response_mask, axis=-1)

    def _sequence_max(values):
        mask_bool = response_mask.bool()
        neg_inf = torch.tensor(float("-inf"), dtype=values.dtype)
        masked_values = values.masked_fill(~mask_bool, neg_inf)
        max_values = masked_values.max(dim=-1).values
        return torch.where(max_values == neg_inf, torch.zeros_like(max_values), max_values)

    for option_name in normalized_options:
        upper_value = threshold_specs[option_name]["upper"]
        lower_value = threshold_specs[option_name]["lower"]
        if option_name.endswith("k1"):
            lower_log = math.log(lower_value)
            upper_log = math.log(upper_value)
        if option_name == "token_k1":
            token_keep_bool = (token_k1 >= lower_log) & (token_k1 <= upper_log)
        elif option_name == "token_k2":
            token_keep_bool = token_k2 <= upper_value
        elif option_name == "token_k3":
            token_keep_bool = token_k3 <= upper_value
        else:
            stat = {"k1": token_k1, "k2": token_k2, "k3": token_k3}[option_name[-2:]]
            reduce = (_sequence_sum if option_name.startswith("seq_sum")
                      else _sequence_mean if option_name.startswith("seq_mean") else _sequence_max)
            seq_stat = reduce(stat)
            if option_name.endswith("k1"):
                seq_keep_bool_direct = (seq_stat >= lower_log) & (seq_stat <= upper_log)
            else:
                seq_keep_bool_direct = seq_stat <= upper_value
            token_keep_bool = seq_keep_bool_direct.unsqueeze(-1).expand_as(response_mask_bool)
        token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
        combined_mask = combined_mask * token_keep_mask
    final_mask = combined_mask
    modified_response_mask = (response_mask * final_mask).to(dtype=response_mask.dtype)
    return modified_response_mask


def compute_rollout_correction_weights(log_ratio, response_mask, rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=False):
    rollout_is_threshold_upper, rollout_is_threshold_lower = _parse_rollout_is_threshold(rollout_is_threshold)
    use_icepop = rollout_is_threshold_lower is not None
    if rollout_is == "token":
        log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        raw_rollout_is_weights = torch.exp(log_ratio_safe)
    elif rollout_is == "sequence":
        log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        raw_rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(log_ratio)
    else:
        raise ValueError(f"Unsupported rollout_is: {rollout_is}")
    raw_rollout_is_weights = raw_rollout_is_weights * response_mask
    if not use_icepop:
        rollout_is_weights = raw_rollout_is_weights.clamp(max=rollout_is_threshold_upper)
    else:
        token_kept_mask = (raw_rollout_is_weights >= rollout_is_threshold_lower) & (
            raw_rollout_is_weights <= rollout_is_threshold_upper)
        rollout_is_weights = torch.where(token_kept_mask, raw_rollout_is_weights,
                                         torch.zeros_like(raw_rollout_is_weights))
    rollout_is_weights = rollout_is_weights.detach()
    if rollout_is_batch_normalize:  # the single-process branch (torch.distributed not initialised)
        if rollout_is == "token":
            weights_mean = masked_mean(rollout_is_weights, response_mask)
        else:
            seq_weights = masked_mean(rollout_is_weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=rollout_is_weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if weights_mean > 1e-8:
            rollout_is_weights = rollout_is_weights / weights_mean
    return rollout_is_weights


def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
                                                  rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                                                  rollout_rs=None, rollout_rs_threshold=None):
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    log_ratio = old_log_prob - rollout_log_prob
    rollout_is_weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        rollout_is_weights = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is,
                                                                rollout_is_threshold, rollout_is_batch_normalize)
    modified_response_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled.")
        modified_response_mask = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs,
                                                                rollout_rs_threshold)
    return rollout_is_weights, modified_response_mask


def compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode="seq-mean-token-sum", rollout_is_weights=None, **global_batch_info):
    if rollout_is_weights is not None:
        pg_losses = -advantages * log_prob * rollout_is_weights
    else:
        pg_losses = -advantages * log_prob
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    negative_approx_kl = log_prob - rollout_log_prob
    kl_divergence = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/ppo_kl": kl_divergence.detach().item()}


def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                    rollout_correction=None, rollout_is_weights=None, **global_batch_info):
    # rollout_correction: the dict of config.policy_loss.rollout_correction; the clip ratios stand for config's
    rollout_corr_config = rollout_correction
    if rollout_corr_config is None:
        raise ValueError("rollout_correction config not found in policy_loss.")
    loss_type = rollout_corr_config.get("loss_type", "ppo_clip")
    rollout_is = rollout_corr_config.get("rollout_is", None)
    rollout_is_threshold = rollout_corr_config.get("rollout_is_threshold", 2.0)
    rollout_is_batch_normalize = rollout_corr_config.get("rollout_is_batch_normalize", False)
    rollout_rs = rollout_corr_config.get("rollout_rs", None)
    rollout_rs_threshold = rollout_corr_config.get("rollout_rs_threshold", None)
    rollout_log_prob = old_log_prob
    with torch.no_grad():
        computed_is_weights, modified_response_mask = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask,
            rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold)
    effective_mask = modified_response_mask
    if loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(
            rollout_log_prob, log_prob, advantages, effective_mask, loss_agg_mode,
            rollout_is_weights=computed_is_weights, **global_batch_info)
    elif loss_type == "ppo_clip":
        pg_loss, clipfrac, kl, lower = compute_policy_loss_vanilla(
            rollout_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, rollout_is_weights=None,
            **global_batch_info)
        pg_metrics = {"actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": kl.item(),
                      "actor/pg_clipfrac_lower": lower.item()}
    else:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    return pg_loss, pg_metrics
