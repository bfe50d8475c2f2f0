"""Every ADVANTAGE_ESTIMATORS entry against verl's core_algos (transcribed in verl_reference), in float64."""

import threading

import numpy as np
import pytest
import torch

from scalerl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    describe_advantage_estimators,
    estimator_needs,
    get_advantage_estimator,
)
from tests.algorithms import verl_reference as verl

TOL = {"atol": 1e-6, "rtol": 1e-6}
# groups of 4, 3, 1 (singleton) and 2, interleaved; GROUPS_NO_SINGLETON for estimators that reject groups of one
GROUPS = [0, 1, 0, 2, 1, 0, 3, 1, 0, 3]
GROUPS_NO_SINGLETON = [0, 1, 0, 2, 1, 0, 2, 1, 0, 2]


def batch(seed: int, groups, binary: bool = False):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (len(groups),), generator=gen)
    mask = (torch.arange(7)[None, :] < lengths[:, None]).double()
    rewards = 0.1 * torch.randn(mask.shape, generator=gen, dtype=torch.float64) * mask
    score = torch.randint(0, 2, (len(groups),), generator=gen).double()
    if binary:
        rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(groups)), lengths - 1] += score
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    baselines = torch.rand(len(groups), generator=gen, dtype=torch.float64)
    return rewards, mask, values, baselines


def reference(name, rewards, mask, values, baselines, index, gamma, lam, norm):
    r = rewards.clone()
    if name == "gae":
        return verl.compute_gae_advantage_return(r, values, mask, gamma, lam)
    if name == "grpo":
        return verl.compute_grpo_outcome_advantage(r, mask, index, norm_adv_by_std_in_grpo=norm)
    if name == "grpo_vectorized":
        return verl.compute_grpo_vectorized_outcome_advantage(r, mask, index, norm_adv_by_std_in_grpo=norm)
    if name == "grpo_passk":
        return verl.compute_grpo_passk_outcome_advantage(r, mask, index, norm_adv_by_std_in_grpo=norm)
    if name == "reinforce_plus_plus":
        return verl.compute_reinforce_plus_plus_outcome_advantage(r, mask, gamma)
    if name == "remax":
        return verl.compute_remax_outcome_advantage(r, baselines, mask)
    fn = {"reinforce_plus_plus_baseline": verl.compute_reinforce_plus_plus_baseline_outcome_advantage,
          "rloo": verl.compute_rloo_outcome_advantage, "rloo_vectorized": verl.compute_rloo_vectorized_outcome_advantage,
          "opo": verl.compute_opo_outcome_advantage, "gpg": verl.compute_gpg_outcome_advantage}[name]
    return fn(r, mask, index)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_estimator_matches_verl(name, norm, seed):
    groups = GROUPS_NO_SINGLETON if name == "grpo_passk" else GROUPS
    rewards, mask, values, baselines = batch(seed, groups, binary=(seed == 2))
    if name == "grpo_vectorized":  # verl computes its statistics in float32; compare at that precision
        rewards = rewards.float()
        mask = mask.float()
    index = np.array(groups)
    gamma, lam = (0.99, 0.95) if seed == 1 else (1.0, 1.0)
    inputs = AdvantageInputs(rewards, mask, index=[f"uid-{g}" for g in groups], values=values,
                             reward_baselines=baselines, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm)
    adv, ret = ADVANTAGE_ESTIMATORS[name](inputs)
    ref_adv, ref_ret = reference(name, rewards, mask, values, baselines, index, gamma, lam, norm)
    torch.testing.assert_close(adv, ref_adv.to(adv.dtype), **TOL)
    torch.testing.assert_close(ret, ref_ret.to(ret.dtype), **TOL)
    assert torch.all(adv[mask == 0] == 0) or name == "gae"
    assert adv.abs().sum() > 0 and not adv.requires_grad


def test_estimators_edge_cases_follow_verl():
    rewards = torch.tensor([[2.0], [1.0], [0.0], [1.0], [1.0]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    ids = ["solo", "g", "g", "h", "h"]
    rloo, _ = ADVANTAGE_ESTIMATORS["rloo"](AdvantageInputs(rewards, mask, index=ids))
    rloo_vec, _ = ADVANTAGE_ESTIMATORS["rloo_vectorized"](AdvantageInputs(rewards, mask, index=ids))
    assert rloo[0, 0] == 2.0 and rloo_vec[0, 0] == 0.0  # a group of one keeps its score only in the loop version
    torch.testing.assert_close(rloo[1:], rloo_vec[1:])
    torch.testing.assert_close(rloo[1:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64))
    passk, _ = ADVANTAGE_ESTIMATORS["grpo_passk"](AdvantageInputs(rewards[1:], mask[1:], index=ids[1:]))
    # group g: only the best response gets (1 - 0) / (std + eps); group h is tied at the top: 0
    torch.testing.assert_close(passk[:, 0], torch.tensor([1 / (2 ** 0.5 / 2 + 1e-6), 0, 0, 0], dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 samples"):
        ADVANTAGE_ESTIMATORS["grpo_passk"](AdvantageInputs(rewards, mask, index=ids))


def test_missing_inputs_and_unknown_names_raise_clearly():
    rewards, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs AdvantageInputs.values"):
        get_advantage_estimator("gae")(AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="needs AdvantageInputs.reward_baselines"):
        get_advantage_estimator("remax")(AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="needs AdvantageInputs.index"):
        get_advantage_estimator("rloo")(AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*grpo, .*remax"):
        get_advantage_estimator("ppo")
    assert estimator_needs("gae") == ("values",) and estimator_needs("reinforce_plus_plus") == ()


def test_registry_lists_verl_names_with_descriptions():
    names = [name for name, _ in describe_advantage_estimators()]
    assert set(names) == {"gae", "grpo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus",
                          "reinforce_plus_plus_baseline", "remax", "rloo", "rloo_vectorized", "opo", "gpg"}
    assert all(desc and "\n" not in desc for _, desc in describe_advantage_estimators())


def run_on_two_ranks(fn, shards):
    """fn(shard, all_reduce) on two threads whose all_reduce is a SUM over both, as over two DP ranks."""
    barrier, slots, results = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def rank_main(rank):
        def all_reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        results[rank] = fn(shards[rank], all_reduce)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


SHARDED_GROUPS = [0, 0, 1, 1, 1, 2, 3, 3, 4, 4]  # whole groups on each rank: rows 0..5 and 6..9


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "gae"])
def test_sharded_batch_uses_global_statistics(name):
    """Two DP shards with all_reduce give the full batch's advantages (whitening and GPG's alpha are global)."""
    rewards, mask, values, _ = batch(3, SHARDED_GROUPS)
    rewards[6] = 0.0  # the shards' shares of non-zero scores differ (GPG's alpha)
    rewards[0, 0] = 1.0
    groups = np.array(SHARDED_GROUPS)
    full, _ = ADVANTAGE_ESTIMATORS[name](AdvantageInputs(rewards, mask, index=groups, values=values, gamma=0.9))
    shards = [slice(0, 6), slice(6, 10)]

    def one_rank(rows, all_reduce):
        inputs = AdvantageInputs(rewards[rows], mask[rows], index=groups[rows], values=values[rows], gamma=0.9,
                                 all_reduce=all_reduce)
        return ADVANTAGE_ESTIMATORS[name](inputs)[0]

    sharded = torch.cat(run_on_two_ranks(one_rank, shards))
    torch.testing.assert_close(sharded, full, **TOL)
    local = torch.cat([one_rank(rows, None) for rows in shards])
    assert not torch.allclose(local, full)  # without all_reduce the shards' own statistics differ
