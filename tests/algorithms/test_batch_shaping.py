"""KL in the reward, DAPO's group filter and overlong penalty, TRL's truncation mask, pass@k / mean@k / maj@k."""

import math
import threading

import numpy as np
import pytest
import torch

from scalerl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    groups_with_signal,
    majority_value,
    make_kl_controller,
    mask_truncated_completions,
    overlong_penalty,
    pass_at_k,
    sampled_eval_metrics,
)
from tests.algorithms import verl_reference as verl

TOL = {"atol": 1e-6, "rtol": 1e-6}


def kl_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (6,), generator=gen)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    scores = torch.randn(6, 6, generator=gen, dtype=torch.float64) * mask
    old = -torch.rand(6, 6, generator=gen, dtype=torch.float64) * 3
    ref = old + 0.5 * torch.randn(6, 6, generator=gen, dtype=torch.float64)
    return scores, old, ref, mask


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k3+"])
@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_apply_kl_penalty_matches_verl_over_steps(ctrl, kind):
    ours = make_kl_controller(ctrl, kl_coef=0.05, target_kl=0.01, horizon=100)
    theirs = (verl.FixedKLController(0.05) if ctrl == "fixed" else verl.AdaptiveKLController(0.05, 0.01, 100))
    for step in range(4):  # the coefficient moves step by step with the adaptive controller
        scores, old, ref, mask = kl_batch(step)
        rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ours, kind)
        ref_rewards, ref_metrics = verl.apply_kl_penalty(scores, old, ref, mask, theirs, kind)
        torch.testing.assert_close(rewards, ref_rewards, **TOL)
        assert metrics.keys() == ref_metrics.keys()
        for key in metrics:
            assert math.isclose(metrics[key], ref_metrics[key], rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(ours.value, theirs.value, rel_tol=1e-12)
    assert (ours.value != 0.05) == (ctrl == "adaptive")


def test_kl_controllers_clip_and_resume():
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    c.update(current_kl=10.0, n_steps=5)  # the error is clipped at +0.2
    assert math.isclose(c.value, 0.1 * (1 + 0.2 * 5 / 10))
    restored = AdaptiveKLController(0.1, 0.1, 10)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value
    assert isinstance(make_kl_controller("fixed"), FixedKLController) and make_kl_controller().value == 0.001
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", horizon=0)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        make_kl_controller("pid")


def test_apply_kl_penalty_sharded_updates_like_full_batch():
    scores, old, ref, mask = kl_batch(9)
    full = AdaptiveKLController(0.05, 0.01, 100)
    apply_kl_penalty(scores, old, ref, mask, full, "kl")
    barrier, slots, values = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def rank_main(rank, rows):
        def all_reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        controller = AdaptiveKLController(0.05, 0.01, 100)
        apply_kl_penalty(scores[rows], old[rows], ref[rows], mask[rows], controller, "kl", all_reduce=all_reduce)
        values[rank] = controller.value

    threads = [threading.Thread(target=rank_main, args=(r, rows)) for r, rows in enumerate([slice(0, 2), slice(2, 6)])]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert values[0] == values[1] and math.isclose(values[0], full.value, rel_tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_filter_matches_dapo_recipe(seed):
    rng = np.random.default_rng(seed)
    uids = [f"p{g}" for g in rng.integers(0, 6, size=24)] + ["single"]
    acc = rng.integers(0, 2, size=25).astype(float)  # binary accuracy: many groups all-0 or all-1
    acc[[i for i, u in enumerate(uids) if u == "p0"]] = 1.0  # one group certainly constant
    keep, kept, dropped = groups_with_signal(torch.tensor(acc), uids)
    expected = set(verl.dapo_kept_prompt_uids(uids, acc.tolist()))
    assert {u for u, k in zip(uids, keep.tolist()) if k} == expected
    assert kept == len(expected) and kept + dropped == len(set(uids)) and dropped >= 1
    assert "single" in expected  # a group of one is kept


def test_group_filter_drops_equal_floats_that_np_std_rounds_above_zero():
    keep, kept, dropped = groups_with_signal(torch.tensor([0.1, 0.1, 0.1, 0.2, 0.3, 0.3]), [0, 0, 0, 1, 1, 1])
    assert keep.tolist() == [False] * 3 + [True] * 3 and (kept, dropped) == (1, 1)
    assert np.std([0.1, 0.1, 0.1]) > 0  # why verl's rule would have kept the first group


def test_overlong_penalty_matches_dapo_reward_manager():
    lengths = torch.arange(0, 129)
    ours = overlong_penalty(lengths, max_response_length=128, buffer_len=32, penalty_factor=0.5)
    ref = torch.tensor([verl.overlong_reward(int(n), 128, 32, 0.5) for n in lengths], dtype=torch.float64)
    torch.testing.assert_close(ours, ref)
    assert ours[96] == 0 and ours[97] < 0 and math.isclose(ours[128].item(), -0.5)
    with pytest.raises(ValueError, match="overlong buffer len"):
        overlong_penalty(lengths, 128, 0)


def test_mask_truncated_completions():
    mask = torch.ones(3, 4)
    out = mask_truncated_completions(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4, 0, 4]


def brute_force_pass_at_k(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 5), (10, 8, 3), (16, 1, 16), (5, 5, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert math.isclose(pass_at_k(n, c, k), brute_force_pass_at_k(n, c, k), abs_tol=1e-12)
    assert math.isclose(pass_at_k(n, c, 1), c / n)
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


def test_majority_value_matches_verl():
    preds, vals = ["A", "B", "A", "C", "B"], [0.9, 0.1, 0.7, 0.0, 0.2]
    ref = verl.calc_maj_val([{"pred": p, "val": v} for p, v in zip(preds, vals)], "pred", "val")
    assert majority_value(preds, vals) == ref == 0.9  # A and B tie: the first seen wins, its first value


def test_sampled_eval_metrics_per_data_source():
    sources = ["gsm"] * 8 + ["math"] * 4
    prompts = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    correct = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1]
    preds = ["4", "5", "5", "6", "x", "y", "x", "x", "7", "7", "8", "7"]
    out = sampled_eval_metrics(sources, prompts, [float(c) for c in correct], correct, k=4, predictions=preds)
    assert out["val/gsm/pass@4"] == 0.5 and out["val/math/pass@4"] == 1.0
    assert out["val/gsm/mean@4"] == 0.125 and out["val/math/mean@4"] == 0.75
    assert out["val/gsm/maj@4"] == 0.0 and out["val/math/maj@4"] == 1.0
    two = sampled_eval_metrics(sources, prompts, [float(c) for c in correct], correct, k=2)
    assert math.isclose(two["val/gsm/pass@2"], (brute_force_pass_at_k(4, 1, 2) + 0) / 2)
    assert "val/gsm/maj@2" not in two
    with pytest.raises(ValueError, match="at least 5 samples"):
        sampled_eval_metrics(sources, prompts, correct, correct, k=5)
