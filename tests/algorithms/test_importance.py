"""Truncated importance weights: min(exp(old - rollout), cap) per valid token, and the mismatch stats."""

import math

import torch

from scalerl.algorithms.importance import truncated_importance_weights


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
