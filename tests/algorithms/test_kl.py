"""kl_penalty against verl's kl_penalty, values and gradients, including the '+' variants."""

import pytest
import torch

from scalerl.algorithms.kl import KL_KINDS, kl_penalty
from tests.algorithms import verl_reference as verl

TOL = dict(atol=1e-6, rtol=1e-6)
ALL_KINDS = KL_KINDS + tuple(kind + "+" for kind in KL_KINDS)


def logps(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=gen) * 4
    ref_logp = logp + torch.randn(4, 6, generator=gen)
    ref_logp[0, 0] = logp[0, 0] + 30.0  # past the +-20 log-ratio clamp and the +-10 k3 clamp
    ref_logp[0, 1] = logp[0, 1] - 30.0
    return logp, ref_logp


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_kl_matches_verl_value_and_gradient(seed, kind):
    logp, ref_logp = logps(seed)
    ours_in = logp.clone().requires_grad_(True)
    ref_in = logp.clone().requires_grad_(True)
    ours = kl_penalty(ours_in, ref_logp, kind)
    ref = verl.kl_penalty(ref_in, ref_logp, kind)
    torch.testing.assert_close(ours, ref, **TOL)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(seed + 10))
    (grad,) = torch.autograd.grad((ours * weights).sum(), ours_in)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), ref_in)
    torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_straight_through_is_value_of_kind_and_gradient_of_k2(kind):
    logp, ref_logp = logps(2)
    logp.requires_grad_(True)
    value = kl_penalty(logp, ref_logp, kind + "+")
    torch.testing.assert_close(value, kl_penalty(logp, ref_logp, kind), **TOL)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(grad, (logp - ref_logp).detach(), **TOL)


def test_k3_is_nonnegative_and_clamped():
    logp, ref_logp = logps(3)
    k3 = kl_penalty(logp, ref_logp, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all() and k3[0, 0] == 10


def test_unknown_kind_raises():
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")
