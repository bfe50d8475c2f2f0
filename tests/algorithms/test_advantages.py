"""grpo_advantages / gae_advantages / masked helpers against verl's definitions."""

import numpy as np
import pytest
import torch

from scalerl.algorithms.advantages import gae_advantages, group_index, grpo_advantages
from scalerl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from tests.algorithms import verl_reference as verl

TOL = dict(atol=1e-6, rtol=1e-6)


def right_padded_mask(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    return (torch.arange(length)[None, :] < lengths[:, None]).float()


def outcome_rewards(mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Score on the last valid token (0/1, sometimes fractional), plus small per-token noise."""
    rewards = 0.1 * torch.randn(mask.shape, generator=gen) * mask
    last = mask.sum(-1).long() - 1
    score = torch.randint(0, 2, (mask.shape[0],), generator=gen).float()
    rewards[torch.arange(mask.shape[0]), last] += score
    return rewards


# groups of 4, 3, 1 (singleton) and 2; interleaved so members are not contiguous
GROUPS = [0, 1, 0, 2, 1, 0, 3, 1, 0, 3]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("id_form", ["list_str", "numpy_int", "tensor"])
def test_grpo_matches_verl(seed, norm_by_std, id_form):
    gen = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(len(GROUPS), 7, gen)
    rewards = outcome_rewards(mask, gen)
    ids = {"list_str": [f"prompt-{g}" for g in GROUPS], "numpy_int": np.array(GROUPS),
           "tensor": torch.tensor(GROUPS)}[id_form]

    adv, ret = grpo_advantages(rewards, mask, ids, norm_by_std=norm_by_std)
    ref_adv, _ = verl.compute_grpo_outcome_advantage(rewards.clone(), mask, np.array(GROUPS),
                                                     norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    assert ret is adv
    assert torch.all(adv[mask == 0] == 0)


def test_grpo_singleton_and_constant_group():
    rewards = torch.tensor([[0.0, 2.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    mask = torch.ones_like(rewards)
    adv, _ = grpo_advantages(rewards, mask, ["a", "b", "b", "b"])
    # singleton: (s - 0) / (1 + eps); constant group: 0 / (0 + eps) = 0
    torch.testing.assert_close(adv[0], torch.full((2,), 2.0 / (1 + 1e-6)))
    assert torch.all(adv[1:] == 0)


def test_grpo_does_not_track_gradients():
    rewards = torch.randn(4, 3, requires_grad=True)
    adv, _ = grpo_advantages(rewards, torch.ones(4, 3), [0, 0, 1, 1])
    assert not adv.requires_grad


def test_group_index_handles_hashables():
    codes = group_index([("p", 1), ("q", 2), ("p", 1)])
    assert codes.tolist() == [0, 1, 0]
    assert group_index(np.array(["b", "a", "b"])).tolist() == [1, 0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_verl(seed, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(6, 9, gen)
    mask[0, 2] = 0  # an observation token inside a response: GAE must skip it
    rewards = torch.randn(mask.shape, generator=gen) * mask
    values = torch.randn(mask.shape, generator=gen)

    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = verl.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)


def test_masked_helpers_match_verl():
    gen = torch.Generator().manual_seed(0)
    mask = right_padded_mask(5, 6, gen)
    values = torch.randn(mask.shape, generator=gen)
    values[mask == 0] = float("nan")  # garbage in padding must not leak
    torch.testing.assert_close(masked_sum(values, mask), verl.masked_sum(values, mask), **TOL)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), verl.masked_mean(values, mask, -1), **TOL)
    clean = torch.nan_to_num(values)
    torch.testing.assert_close(masked_var(clean, mask), verl.masked_var(clean, mask), **TOL)
    torch.testing.assert_close(masked_whiten(clean, mask), verl.masked_whiten(clean, mask), **TOL)
    assert torch.isfinite(masked_mean(values, mask))
    one_valid = torch.zeros_like(mask)
    one_valid[0, 0] = 1
    with pytest.raises(ValueError):
        masked_var(clean, one_valid)
