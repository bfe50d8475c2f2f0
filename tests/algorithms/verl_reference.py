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
"""

from __future__ import annotations

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
