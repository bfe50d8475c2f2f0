"""Truncated importance weights: min(exp(old - rollout), cap) per valid token, and the mismatch stats."""

import math

import pytest
import torch

from scalerl.algorithms.importance import rollout_correction_weights, truncated_importance_weights
from scalerl.algorithms.losses import policy_loss


def test_weights_are_the_capped_ratio_and_zero_on_padding():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = truncated_importance_weights(old, rollout, mask, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0, 0.0]]))
    assert stats["rollout/logprob_diff/max"] == 2.5
    assert abs(stats["rollout/logprob_diff/mean"] - (0.5 + 1.0 + 2.5) / 3) < 1e-6


def test_equal_log_probs_give_unit_weights():
    logp = torch.randn(3, 5)
    weights, stats = truncated_importance_weights(logp, logp.clone(), torch.ones(3, 5), cap=2.0)
    assert torch.equal(weights, torch.ones(3, 5)) and stats["rollout/logprob_diff/max"] == 0.0


# ---- transcriptions of the published formulas (written out here, never imported) ----------------------


def _trl_ratio(old, sampling, mask, mode, cap):
    """TRL GRPOTrainer's vllm_importance_sampling_ratio (its `_generate_and_score_completions`)."""
    diff = (old - sampling) * mask
    logps_diff = diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(logps_diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=cap)
    return ratio.masked_fill(ratio > cap, value=0.0)


def _verl_weights(old, rollout, mask, level, threshold):
    """verl's compute_rollout_correction_weights (rollout_is=token|sequence, truncation at the threshold)."""
    log_ratio = old - rollout
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True)
        w = torch.exp(torch.clamp(s, -20.0, 20.0)).expand_as(log_ratio)
    w = w * mask
    mean_before = (w * mask).sum() / mask.sum()
    return w.clamp(max=threshold), mean_before


def _areal_decoupled_loss(logprobs, proximal, behav, adv, loss_mask, eps, c_clip, cap):
    """AReaL's ppo_actor_loss_fn with proximal_logprobs (decoupled PPO), token level."""
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal), 0)
    pg_loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps))
    pg_loss = torch.min(pg_loss, torch.sign(adv) * c_clip * adv)
    behav_imp_weight = (proximal - behav).exp()
    behav_mask = (behav_imp_weight <= cap).logical_and(loss_mask)
    behav_imp_weight = torch.where(behav_mask, behav_imp_weight, 0.0)
    pg_loss = pg_loss * behav_imp_weight
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask.count_nonzero()


def _mismatched(seed=0, rows=4, tokens=6, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    proximal = -torch.rand(rows, tokens, generator=g) * 3
    behavior = proximal + (torch.rand(rows, tokens, generator=g) - 0.5) * 2 * spread
    mask = torch.ones(rows, tokens)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return proximal, behavior, mask


@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"),
                                        ("sequence", "mask")])
def test_weights_equal_trl_importance_sampling(level, mode):
    proximal, behavior, mask = _mismatched()
    cap = 1.3
    weights, stats = rollout_correction_weights(proximal, behavior, mask, level, mode, cap)
    expected = _trl_ratio(proximal, behavior, mask, f"{level}_{mode}", cap).expand_as(mask) * mask
    assert torch.allclose(weights, expected, atol=1e-6)
    assert (weights[mask.bool()] <= cap).all() and (weights[~mask.bool()] == 0).all()
    raw = _trl_ratio(proximal, behavior, mask, f"{level}_truncate", float("inf"))
    above = raw > cap
    share = above.float().mean() if level == "sequence" else above[mask.bool()].float().mean()
    assert stats["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float(share))
    assert stats["rollout_corr/weight_mean"] == pytest.approx(float(expected.sum() / mask.sum()), rel=1e-6)
    if mode == "mask":  # something was masked and something kept: the test can tell the modes apart
        assert 0 < float(share) < 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_weights_equal_verl_rollout_is(level):
    proximal, behavior, mask = _mismatched(seed=1)
    weights, stats = rollout_correction_weights(proximal, behavior, mask, level, "truncate", 2.0)
    expected, mean_before = _verl_weights(proximal, behavior, mask, level, 2.0)
    assert torch.allclose(weights, expected, atol=1e-6)
    assert stats["rollout_corr/rollout_is_mean"] == pytest.approx(float(mean_before), rel=1e-6)


def test_sequence_level_is_the_product_of_token_ratios():
    proximal, behavior, mask = _mismatched(seed=2, spread=0.1)
    seq, _ = rollout_correction_weights(proximal, behavior, mask, "sequence", "truncate", 1e6)
    tok, _ = rollout_correction_weights(proximal, behavior, mask, "token", "truncate", 1e6)
    product = torch.where(mask.bool(), tok, torch.ones_like(tok)).prod(-1)
    assert torch.allclose(seq[:, 0], product, rtol=1e-5)
    assert torch.allclose(seq, seq[:, :1].expand_as(seq) * mask)  # one weight per sequence


def test_decoupled_ppo_equals_areal_loss_and_gradient():
    """Decoupled PPO = the dual-clip loss against the proximal (recomputed) log-probs, weighted per token by
    the behaviour weight, masked above the cap: AReaL's loss and gradient, token-mean."""
    proximal, behavior, mask = _mismatched(seed=3)
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(proximal.shape, generator=g)
    logp = (proximal + (torch.rand(proximal.shape, generator=g) - 0.5) * 0.8).requires_grad_(True)
    cap = 1.25
    weights, _ = rollout_correction_weights(proximal, behavior, mask, "token", "mask", cap)
    ours, _ = policy_loss(proximal, logp, adv, mask, 0.2, 0.2, 3.0, "token-mean", token_weights=weights)
    (ours_grad,) = torch.autograd.grad(ours, logp)
    logp_ref = logp.detach().clone().requires_grad_(True)
    theirs = _areal_decoupled_loss(logp_ref, proximal, behavior, adv, mask.bool(), 0.2, 3.0, cap)
    (theirs_grad,) = torch.autograd.grad(theirs, logp_ref)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(ours_grad, theirs_grad, atol=1e-6)
    assert (weights == 0).logical_and(mask.bool()).any()  # the cap masked some tokens


def test_bad_level_mode_cap_are_refused():
    logp = torch.zeros(1, 2)
    for kwargs in ({"level": "row"}, {"mode": "clip"}, {"cap": 0.0}):
        with pytest.raises(ValueError):
            rollout_correction_weights(logp, logp, torch.ones(1, 2), **kwargs)
