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


def policy_stats(seed: int, shape):
    """The optimal token baselines' inputs: old log-probs of real probabilities, sum_v pi_v^2 in [pi^2, 1]
    (the sampled token's share plus the rest of the vocabulary's), rollout importance weights around 1."""
    gen = torch.Generator().manual_seed(100 + seed)
    old_log_probs = torch.nn.functional.logsigmoid(2.0 * torch.randn(shape, generator=gen, dtype=torch.float64))
    pi = old_log_probs.exp()
    sum_pi_squared = pi ** 2 + (1 - pi) ** 2 * torch.rand(shape, generator=gen, dtype=torch.float64)
    is_weights = 0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)
    return old_log_probs, sum_pi_squared, is_weights


def reward_components(seed: int, size: int):
    """Two reward components per sample on different scales (accuracy 0/1, a small format score)."""
    gen = torch.Generator().manual_seed(200 + seed)
    accuracy = torch.randint(0, 2, (size,), generator=gen).float()
    fmt = 0.1 * torch.rand(size, generator=gen)
    return {"accuracy": accuracy.numpy(), "format": fmt.numpy()}


GDPO_WEIGHTS = (1.0, 0.5)
OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")


def reference(name, rewards, mask, values, baselines, index, gamma, lam, norm, components=None, stats=None):
    r = rewards.clone()
    if name == "gdpo":
        return verl.compute_gdpo_outcome_advantage(r, mask, index, norm_adv_by_std_in_grpo=norm,
                                                   gdpo_reward_keys=list(components),
                                                   gdpo_reward_weights=GDPO_WEIGHTS, non_tensor_batch=components,
                                                   response_attention_mask=mask)
    if name in OTB:
        fn = (verl.compute_optimal_token_baseline_advantage if name == OTB[0]
              else verl.compute_multi_turn_optimal_token_baseline_advantage)
        return fn(r, mask, index, *stats)
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
    tol = TOL
    if name in ("grpo_vectorized", "gdpo"):  # verl computes these group statistics in float32
        rewards = rewards.float()
        mask = mask.float()
        tol = {"atol": 1e-5, "rtol": 1e-5}
    index = np.array(groups)
    gamma, lam = (0.99, 0.95) if seed == 1 else (1.0, 1.0)
    components = reward_components(seed, len(groups))
    old_log_probs, sum_pi_squared, is_weights = policy_stats(seed, mask.shape)
    is_weights = is_weights if seed == 1 else None
    inputs = AdvantageInputs(rewards, mask, index=[f"uid-{g}" for g in groups], values=values,
                             reward_baselines=baselines, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm,
                             reward_components=torch.stack([torch.as_tensor(v) for v in components.values()]),
                             reward_weights=GDPO_WEIGHTS, old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
                             rollout_is_weights=is_weights)
    adv, ret = ADVANTAGE_ESTIMATORS[name](inputs)
    ref_adv, ref_ret = reference(name, rewards, mask, values, baselines, index, gamma, lam, norm, components,
                                 (old_log_probs, sum_pi_squared, is_weights))
    torch.testing.assert_close(adv, ref_adv.to(adv.dtype), **tol)
    torch.testing.assert_close(ret, ref_ret.to(ret.dtype), **tol)
    assert torch.all(adv[mask == 0] == 0) or name == "gae"
    assert adv.abs().sum() > 0 and not adv.requires_grad


def holey_batch(seed: int, groups):
    """Multi-turn-like masks: valid tokens in two runs with a masked gap (tool output) between, rows of
    every length, one row with no valid token; rewards on the last valid token plus a little per token."""
    gen = torch.Generator().manual_seed(300 + seed)
    size, width = len(groups), 9
    mask = torch.zeros(size, width, dtype=torch.float64)
    for row in range(size):
        first = int(torch.randint(1, 4, (1,), generator=gen))
        gap = int(torch.randint(0, 3, (1,), generator=gen))
        second = int(torch.randint(0, width - first - gap + 1, (1,), generator=gen))
        mask[row, :first] = 1.0
        mask[row, first + gap:first + gap + second] = 1.0
    mask[3] = 0.0
    rewards = 0.05 * torch.randn(size, width, generator=gen, dtype=torch.float64) * mask
    last = (mask * torch.arange(width)).argmax(dim=-1)
    rewards[torch.arange(size), last] += torch.randint(0, 2, (size,), generator=gen).double() * mask.amax(-1)
    return rewards, mask


# one group with a unique longest row, one with a tie at the top, a singleton, a pair
OTB_LAYOUTS = [[0, 0, 0, 0, 1, 1, 1, 2, 3, 3], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("layout", range(len(OTB_LAYOUTS)))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", OTB)
def test_optimal_token_baselines_match_verl_on_multi_turn_masks(name, seed, layout, handle_zero_tail):
    """Masks with gaps and an empty row, where the two estimators differ (columns vs valid-token ranks)."""
    from scalerl.algorithms import token_baselines

    groups = OTB_LAYOUTS[layout]
    rewards, mask = holey_batch(seed, groups)
    old_log_probs, sum_pi_squared, is_weights = policy_stats(seed, mask.shape)
    is_weights = is_weights if seed == 1 else None
    fn = getattr(token_baselines, f"{name}_advantages")
    adv, ret = fn(rewards, mask, np.array(groups), old_log_probs, sum_pi_squared, is_weights,
                  handle_zero_tail=handle_zero_tail)
    ref_fn = (verl.compute_optimal_token_baseline_advantage if name == OTB[0]
              else verl.compute_multi_turn_optimal_token_baseline_advantage)
    ref_adv, ref_ret = ref_fn(rewards.clone(), mask, np.array(groups), old_log_probs, sum_pi_squared, is_weights,
                              handle_zero_tail=handle_zero_tail)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)
    assert torch.all(adv[mask == 0] == 0) and adv.abs().sum() > 0


def test_optimal_token_baselines_differ_where_valid_tokens_are_not_aligned():
    """The checks above can tell the two apart: with gaps in the masks their advantages differ."""
    from scalerl.algorithms import token_baselines

    rewards, mask = holey_batch(0, OTB_LAYOUTS[0])
    old_log_probs, sum_pi_squared, _ = policy_stats(0, mask.shape)
    args = (rewards, mask, OTB_LAYOUTS[0], old_log_probs, sum_pi_squared)
    plain, _ = token_baselines.optimal_token_baseline_advantages(*args)
    tir, _ = token_baselines.tir_optimal_token_baseline_advantages(*args)
    assert not torch.allclose(plain, tir)


def test_gdpo_normalises_each_component_before_summing():
    """One component equals GRPO then whitening; a component with a large scale does not drown a small one."""
    rewards, mask, _, _ = batch(0, GROUPS)
    components = reward_components(0, len(GROUPS))
    index = np.array(GROUPS)
    one = torch.as_tensor(components["accuracy"]).unsqueeze(0)
    adv, _ = get_advantage_estimator("gdpo")(AdvantageInputs(rewards.float(), mask.float(), index=index,
                                                             reward_components=one))
    ref, _ = verl.compute_gdpo_outcome_advantage(rewards.float(), mask.float(), index,
                                                 gdpo_reward_keys=["accuracy"], non_tensor_batch=components,
                                                 response_attention_mask=mask.float())
    torch.testing.assert_close(adv, ref, atol=1e-5, rtol=1e-5)
    scaled = torch.stack([100 * torch.as_tensor(components["accuracy"]), torch.as_tensor(components["format"])])
    unscaled = torch.stack([torch.as_tensor(components["accuracy"]), torch.as_tensor(components["format"])])
    big, _ = get_advantage_estimator("gdpo")(AdvantageInputs(rewards, mask, index=index, reward_components=scaled))
    small, _ = get_advantage_estimator("gdpo")(AdvantageInputs(rewards, mask, index=index,
                                                               reward_components=unscaled))
    torch.testing.assert_close(big, small, atol=1e-4, rtol=1e-4)  # the scale of a component does not matter
    with pytest.raises(ValueError, match="2 reward components but 3 reward_weights"):
        get_advantage_estimator("gdpo")(AdvantageInputs(rewards, mask, index=index, reward_components=scaled,
                                                        reward_weights=(1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match=r"shape \[K, 10\]"):
        get_advantage_estimator("gdpo")(AdvantageInputs(rewards, mask, index=index, reward_components=scaled[:, :4]))


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
    with pytest.raises(ValueError, match="needs AdvantageInputs.reward_components"):
        get_advantage_estimator("gdpo")(AdvantageInputs(rewards, mask, index=[0, 0]))
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(ValueError, match="needs AdvantageInputs.old_log_probs, .sum_pi_squared"):
            get_advantage_estimator(name)(AdvantageInputs(rewards, mask, index=[0, 0]))
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*grpo, .*remax"):
        get_advantage_estimator("ppo")
    assert estimator_needs("gae") == ("values",) and estimator_needs("reinforce_plus_plus") == ()


def test_registry_lists_verl_names_with_descriptions():
    names = [name for name, _ in describe_advantage_estimators()]
    assert set(names) == {"gae", "grpo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus",
                          "reinforce_plus_plus_baseline", "remax", "rloo", "rloo_vectorized", "opo", "gpg", "gdpo",
                          "optimal_token_baseline", "tir_optimal_token_baseline"}
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


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "gae", "gdpo"])
def test_sharded_batch_uses_global_statistics(name):
    """Two DP shards with all_reduce give the full batch's advantages (whitening and GPG's alpha are global)."""
    rewards, mask, values, _ = batch(3, SHARDED_GROUPS)
    rewards[6] = 0.0  # the shards' shares of non-zero scores differ (GPG's alpha)
    rewards[0, 0] = 1.0
    groups = np.array(SHARDED_GROUPS)
    components = torch.stack([rewards.sum(-1), torch.linspace(0, 1, len(groups), dtype=torch.float64)])
    full, _ = ADVANTAGE_ESTIMATORS[name](AdvantageInputs(rewards, mask, index=groups, values=values, gamma=0.9,
                                                         reward_components=components))
    shards = [slice(0, 6), slice(6, 10)]

    def one_rank(rows, all_reduce):
        inputs = AdvantageInputs(rewards[rows], mask[rows], index=groups[rows], values=values[rows], gamma=0.9,
                                 all_reduce=all_reduce, reward_components=components[:, rows])
        return ADVANTAGE_ESTIMATORS[name](inputs)[0]

    sharded = torch.cat(run_on_two_ranks(one_rank, shards))
    torch.testing.assert_close(sharded, full, **TOL)
    local = torch.cat([one_rank(rows, None) for rows in shards])
    assert not torch.allclose(local, full)  # without all_reduce the shards' own statistics differ
