"""aggregate_loss / policy_loss / value_loss against verl, and micro-batch / DP-rank invariance."""

import pytest
import torch

from scalerl.algorithms.losses import AGG_MODES, aggregate_loss, policy_loss, value_loss
from tests.algorithms import verl_reference as verl

TOL = dict(atol=1e-6, rtol=1e-6)


def padded_mask(batch: int, length: int, gen: torch.Generator, empty_row: bool = True) -> torch.Tensor:
    """Right-padded response mask with random lengths; optionally one fully padded row."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    if empty_row:
        lengths[batch // 2] = 0
    return (torch.arange(length)[None, :] < lengths[:, None]).float()


def ppo_batch(seed: int, batch: int = 8, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    mask = padded_mask(batch, length, gen)
    old_logp = -torch.rand(batch, length, generator=gen) * 3
    # log-ratios of std 1.5 reach r > clip_c = 3 and r < 1 - clip_low: every branch is taken
    logp = (old_logp + 1.5 * torch.randn(batch, length, generator=gen)).requires_grad_(True)
    advantages = torch.randn(batch, length, generator=gen)  # about half negative: dual-clip path
    return old_logp, logp, advantages, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_verl(seed, mode):
    gen = torch.Generator().manual_seed(seed)
    mask = padded_mask(7, 5, gen)
    loss_mat = torch.randn(7, 5, generator=gen)
    torch.testing.assert_close(aggregate_loss(loss_mat, mask, mode), verl.agg_loss(loss_mat, mask, mode), **TOL)


# two DP ranks, each with two micro-batches of unequal size
SHARDS = [[slice(0, 3), slice(3, 4)], [slice(4, 7), slice(7, 10)]]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_microbatches_and_ranks_add_up_to_full_batch(mode):
    gen = torch.Generator().manual_seed(3)
    mask = padded_mask(10, 6, gen)
    loss_mat = torch.randn(10, 6, generator=gen, requires_grad=True)
    full = aggregate_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)

    counts = dict(global_num_tokens=int(mask.sum()), global_num_seqs=int((mask.sum(-1) > 0).sum()),
                  dp_size=len(SHARDS), horizon=mask.shape[-1])
    per_rank = [sum(aggregate_loss(loss_mat[mb], mask[mb], mode, **counts) for mb in rank) for rank in SHARDS]
    # DDP averages over ranks; gradient accumulation sums over micro-batches
    sharded = torch.stack(per_rank).mean()
    (sharded_grad,) = torch.autograd.grad(sharded, loss_mat)
    torch.testing.assert_close(sharded, full, **TOL)
    torch.testing.assert_close(sharded_grad, full_grad, **TOL)


def test_sharded_matches_verl_global_batch_info():
    gen = torch.Generator().manual_seed(4)
    mask = padded_mask(6, 5, gen)
    loss_mat = torch.randn(6, 5, generator=gen)
    ours = aggregate_loss(loss_mat[:2], mask[:2], "token-mean", global_num_tokens=int(mask.sum()), dp_size=3)
    ref = verl.agg_loss(loss_mat[:2], mask[:2], "token-mean", dp_size=3, batch_num_tokens=int(mask.sum()))
    torch.testing.assert_close(ours, ref, **TOL)


def test_aggregate_requires_global_counts_with_dp():
    with pytest.raises(ValueError):
        aggregate_loss(torch.ones(2, 2), torch.ones(2, 2), "token-mean", dp_size=2)
    with pytest.raises(ValueError):
        aggregate_loss(torch.ones(2, 2), torch.ones(2, 2), "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError):
        aggregate_loss(torch.ones(2, 2), torch.ones(2, 2), "token-average")


def test_aggregate_all_padding_gives_zero():
    loss = aggregate_loss(torch.randn(2, 3), torch.zeros(2, 3), "token-mean")
    assert loss.item() == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_matches_verl(seed, mode):
    old_logp, logp, advantages, mask = ppo_batch(seed)
    clip = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)
    loss, metrics = policy_loss(old_logp, logp, advantages, mask, agg=mode, **clip)
    (grad,) = torch.autograd.grad(loss, logp)

    ref_logp = logp.detach().clone().requires_grad_(True)
    ref_loss, clipfrac, ppo_kl, clipfrac_lower = verl.compute_policy_loss_vanilla(
        old_logp, ref_logp, advantages, mask, mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logp)

    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], clipfrac, **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], ppo_kl, **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac_lower"], clipfrac_lower, **TOL)
    assert metrics["pg_clipfrac_lower"] > 0 and metrics["pg_clipfrac"] > 0  # both clip paths exercised
    assert not any(m.requires_grad for m in metrics.values())


def test_policy_loss_ratio_is_clamped():
    old_logp = torch.zeros(1, 2)
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    loss, metrics = policy_loss(old_logp, logp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(0.0))


def test_policy_loss_sharded_equals_full():
    old_logp, logp, advantages, mask = ppo_batch(5, batch=10)
    full, _ = policy_loss(old_logp, logp, advantages, mask)
    counts = dict(global_num_tokens=mask.sum(), dp_size=len(SHARDS))
    per_rank = [sum(policy_loss(old_logp[mb], logp[mb], advantages[mb], mask[mb], **counts)[0] for mb in rank)
                for rank in SHARDS]
    torch.testing.assert_close(torch.stack(per_rank).mean(), full, **TOL)


def test_policy_loss_rejects_small_clip_c():
    with pytest.raises(ValueError):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_c=1.0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_verl(seed, mode):
    gen = torch.Generator().manual_seed(seed)
    mask = padded_mask(6, 5, gen)
    values = torch.randn(6, 5, generator=gen)
    returns = torch.randn(6, 5, generator=gen)
    vpreds = (values + 0.5 * torch.randn(6, 5, generator=gen)).requires_grad_(True)

    loss, metrics = value_loss(vpreds, returns, values, mask, cliprange_value=0.2, agg=mode)
    (grad,) = torch.autograd.grad(loss, vpreds)
    ref_vpreds = vpreds.detach().clone().requires_grad_(True)
    ref_loss, ref_clipfrac = verl.compute_value_loss(ref_vpreds, returns, values, mask, 0.2, mode)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_vpreds)

    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    torch.testing.assert_close(metrics["vf_clipfrac"], ref_clipfrac, **TOL)
    assert 0 < metrics["vf_clipfrac"] < 1
