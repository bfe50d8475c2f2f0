"""Every POLICY_LOSSES entry against verl's core_algos (verl_reference): loss values, gradients and metrics,
in every aggregation mode, with and without importance weights, and micro-batch / DP-rank invariance."""

import dataclasses

import pytest
import torch

from scalerl.algorithms import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLossOptions,
    RolloutCorrectionOptions,
    describe_policy_losses,
    get_policy_loss,
    policy_loss,
)
from scalerl.algorithms.bypass_mode import REJECTION_OPTIONS, rollout_rejection_mask
from tests.algorithms import verl_reference as verl

TOL = {"atol": 1e-6, "rtol": 1e-6}
# bypass_mode: token weights (unused by ppo_clip, as in verl) and a row-level rejection that drops some rows
OPTIONS = PolicyLossOptions(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
                            clip_cov_ratio=0.2, clip_cov_lb=0.5, clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.1,
                            dro_beta=0.5,
                            rollout_correction=RolloutCorrectionOptions(rollout_is="token", rollout_rs="seq_mean_k3",
                                                                        rollout_rs_threshold=0.5))
COVARIANCE = ("clip_cov", "kl_cov")  # pick tokens per call: no micro-batch invariance, random (clip_cov)


def loss_batch(seed: int, batch: int = 8, length: int = 6, empty_row: bool = True):
    """float64 log-probs of real probabilities (< 1), log-ratios wide enough to take every clip branch."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    if empty_row:
        lengths[batch // 2] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    logit = 2.0 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    old_logp = torch.nn.functional.logsigmoid(logit)
    logp = torch.nn.functional.logsigmoid(logit + 1.5 * torch.randn(batch, length, generator=gen, dtype=torch.float64))
    advantages = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    weights = torch.rand(batch, length, generator=gen, dtype=torch.float64) + 0.5
    return old_logp, logp.requires_grad_(True), advantages, mask, weights


def reference_loss(name, old, logp, adv, mask, mode, o, weights, **batch_info):
    """verl's function for ``name`` with options ``o``: sapo / geo_mean as verl 0.9.1 pins them, or with the pin
    released under ``honour_loss_agg_mode``; gspo's pin released (0.9.1 honours loss_agg_mode for it)."""
    clip = {"clip_low": o.low, "clip_high": o.high}
    common = dict(rollout_is_weights=weights, **batch_info)
    if name == "vanilla":
        loss, clipfrac, kl, lower = verl.compute_policy_loss_vanilla(
            old, logp, adv, mask, mode, clip_ratio_low=o.low, clip_ratio_high=o.high, clip_ratio_c=o.dual_clip(3.0),
            rollout_is_weights=weights, **batch_info)
        return loss, {"actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": kl.item(),
                      "actor/pg_clipfrac_lower": lower.item()}
    if name == "gspo":
        return verl.compute_policy_loss_gspo(old, logp, adv, mask, mode, **clip, pinned_agg_mode=None, **common)
    if name == "sapo":
        pinned = None if o.honour_loss_agg_mode else "seq-mean-token-mean"
        return verl.compute_policy_loss_sapo(old, logp, adv, mask, mode, o.tau_pos, o.tau_neg, pinned_agg_mode=pinned,
                                             **common)
    if name == "geo_mean":
        return verl.compute_policy_loss_geo_mean(old, logp, adv, mask, mode, **clip,
                                                 verl_mean=not o.honour_loss_agg_mode, **common)
    if name == "dro":
        return verl.compute_policy_loss_dro(old, logp, adv, mask, mode, dro_beta=o.dro_beta, **common)
    if name == "bypass_mode":
        return verl.compute_policy_loss_bypass_mode(old, logp, adv, mask, mode, o.low, o.high, o.dual_clip(3.0),
                                                    rollout_correction=dataclasses.asdict(o.rollout_correction),
                                                    **common)
    if name == "clip_cov":
        return verl.compute_policy_loss_clip_cov(old, logp, adv, mask, mode, **clip, clip_cov_ratio=o.clip_cov_ratio,
                                                 clip_cov_lb=o.clip_cov_lb, clip_cov_ub=o.clip_cov_ub, **common)
    if name == "kl_cov":
        return verl.compute_policy_loss_kl_cov(old, logp, adv, mask, mode, kl_cov_ratio=o.kl_cov_ratio,
                                               ppo_kl_coef=o.ppo_kl_coef, **common)
    if name == "gpg":
        return verl.compute_policy_loss_gpg(old, logp, adv, mask, mode, **common)
    if name in ("dppo_tv", "dppo_kl"):
        fn = verl.compute_policy_loss_dppo_tv if name == "dppo_tv" else verl.compute_policy_loss_dppo_kl
        return fn(old, logp, adv, mask, mode, **clip, clip_ratio_c=o.dual_clip(20.0), **common)
    return verl.compute_policy_loss_cispo(old, logp, adv, mask, mode, **clip, **common)


def ours_and_verl(name, seed, mode, options=OPTIONS, weighted=False, ours_counts=None, verl_counts=None,
                  empty_row=True):
    old, logp, adv, mask, weights = loss_batch(seed, empty_row=empty_row)
    weights = weights if weighted else None
    torch.manual_seed(1000 + seed)  # clip_cov draws its random picks from the global generator, as verl does
    loss, metrics = POLICY_LOSSES[name](old, logp, adv, mask, mode, options, token_weights=weights,
                                        **(ours_counts or {}))
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_(True)
    torch.manual_seed(1000 + seed)
    ref_loss, ref_metrics = reference_loss(name, old, ref_logp, adv, mask, mode, options, weights,
                                           **(verl_counts or {}))
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logp)
    return (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics)


def assert_same(ours, ref):
    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = ours, ref
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert set(metrics) == {k.removeprefix("actor/") for k in ref_metrics}
    for key, value in metrics.items():
        assert not value.requires_grad
        assert abs(value.item() - ref_metrics[f"actor/{key}"]) <= 1e-6, key


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_loss_matches_verl(name, mode, seed):
    ours, ref = ours_and_verl(name, seed, mode, weighted=(seed == 1))
    assert_same(ours, ref)
    assert ours[1].abs().sum() > 0  # a gradient flows
    assert set(ours[2]) == set(POLICY_LOSSES[name].metric_names)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "dppo_tv", "dppo_kl"])
def test_clipping_paths_are_exercised(name):
    """The random batches take the clip branches these losses report, so the metric checks above can fail."""
    metrics = [ours_and_verl(name, seed, "token-mean")[0][2] for seed in (0, 1)]
    assert all(m["pg_clipfrac"] > 0 for m in metrics)
    if name in ("vanilla", "geo_mean", "dppo_tv", "dppo_kl"):
        assert any(m["pg_clipfrac_lower"] > 0 for m in metrics)


@pytest.mark.parametrize("mode", [None, "token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name", ["gspo", "sapo", "geo_mean"])
def test_pinned_aggregation_follows_verl_0_9_1(name, mode):
    """sapo always aggregates seq-mean-token-mean and geo_mean takes a plain mean over rows, whatever the mode
    (verl 0.9.1); gspo honours the mode, seq-mean-token-mean when none is given."""
    old, logp, adv, mask, _ = loss_batch(3)
    loss, _ = POLICY_LOSSES[name](old, logp, adv, mask, mode, OPTIONS)
    o = OPTIONS
    if name == "gspo":
        ref, _ = verl.compute_policy_loss_gspo(old, logp, adv, mask, mode or "seq-mean-token-mean", o.low, o.high,
                                               pinned_agg_mode=None)
    elif name == "sapo":
        ref, _ = verl.compute_policy_loss_sapo(old, logp, adv, mask, mode, o.tau_pos, o.tau_neg)
    else:
        ref, _ = verl.compute_policy_loss_geo_mean(old, logp, adv, mask, mode, o.low, o.high)
    torch.testing.assert_close(loss, ref, **TOL)
    assert POLICY_LOSSES[name].default_agg_mode == "seq-mean-token-mean"
    assert POLICY_LOSSES["vanilla"].default_agg_mode == "token-mean"


@pytest.mark.parametrize("name", ["sapo", "geo_mean"])
def test_honour_loss_agg_mode_keeps_the_earlier_behaviour(name):
    """honour_loss_agg_mode lets loss_agg_mode decide for sapo / geo_mean, as scalerl did before verl 0.9.1's
    pin; on this batch (an empty row, unequal lengths) the two differ, so both checks can fail."""
    honour = dataclasses.replace(OPTIONS, honour_loss_agg_mode=True)
    ours, ref = ours_and_verl(name, 0, "token-mean", options=honour)
    assert_same(ours, ref)
    pinned, _ = ours_and_verl(name, 0, "token-mean")
    assert not torch.allclose(ours[0], pinned[0])


SHARDS = [[slice(0, 3), slice(3, 4)], [slice(4, 7), slice(7, 10)]]  # two DP ranks, two unequal micro-batches each


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n not in COVARIANCE])
def test_microbatches_and_ranks_add_up_to_full_batch(name, mode):
    old, logp, adv, mask, weights = loss_batch(5, batch=10)
    fn = POLICY_LOSSES[name]
    # verl 0.9.1's geo_mean is a mean over each call's rows: only its aggregated form adds up
    options = dataclasses.replace(OPTIONS, honour_loss_agg_mode=True) if name == "geo_mean" else OPTIONS
    full, _ = fn(old, logp, adv, mask, mode, options, token_weights=weights)
    (full_grad,) = torch.autograd.grad(full, logp)
    counts = {"global_num_tokens": mask.sum(), "global_num_seqs": (mask.sum(-1) > 0).sum(), "dp_size": len(SHARDS),
                  "horizon": mask.shape[-1]}
    per_rank = [sum(fn(old[mb], logp[mb], adv[mb], mask[mb], mode, options, token_weights=weights[mb], **counts)[0]
                    for mb in rank) for rank in SHARDS]
    sharded = torch.stack(per_rank).mean()  # DDP averages over ranks; accumulation sums micro-batches
    (sharded_grad,) = torch.autograd.grad(sharded, logp)
    torch.testing.assert_close(sharded, full, **TOL)
    torch.testing.assert_close(sharded_grad, full_grad, **TOL)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_global_batch_info_matches_verl(name, mode):
    """One micro-batch of a larger global batch: our counts equal verl's config.global_batch_info."""
    ours_counts = {"global_num_tokens": 40, "global_num_seqs": 12, "dp_size": 3, "horizon": 9}
    verl_counts = {"batch_num_tokens": 40, "global_batch_size": 12, "dp_size": 3, "loss_scale_factor": 9}
    ours, ref = ours_and_verl(name, 2, mode, ours_counts=ours_counts, verl_counts=verl_counts)
    assert_same(ours, ref)


def test_vanilla_entry_is_policy_loss():
    old, logp, adv, mask, weights = loss_batch(4)
    entry, _ = get_policy_loss("vanilla")(old, logp, adv, mask, "seq-mean-token-sum", OPTIONS, token_weights=weights)
    direct, _ = policy_loss(old, logp, adv, mask, 0.2, 0.28, 3.0, "seq-mean-token-sum", token_weights=weights)
    torch.testing.assert_close(entry, direct)


def test_options_fall_back_as_in_verl():
    o = PolicyLossOptions(clip_ratio=0.3)
    assert (o.low, o.high, o.dual_clip(3.0), o.dual_clip(20.0)) == (0.3, 0.3, 3.0, 20.0)
    o = PolicyLossOptions(clip_ratio=0.3, clip_ratio_high=0.4, clip_ratio_c=10.0)
    assert (o.low, o.high, o.dual_clip(3.0)) == (0.3, 0.4, 10.0)
    assert PolicyLossOptions().ppo_kl_coef == 0.1 and PolicyLossOptions().tau_neg == 1.05


def test_clip_cov_generator_makes_the_pick_reproducible():
    old, logp, adv, mask, _ = loss_batch(6)
    fn = get_policy_loss("clip_cov")
    a, ma = fn(old, logp, adv, mask, "token-mean", OPTIONS, generator=torch.Generator().manual_seed(7))
    b, _mb = fn(old, logp, adv, mask, "token-mean", OPTIONS, generator=torch.Generator().manual_seed(7))
    assert a.item() == b.item() and ma["pg_clipfrac"] > 0
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        fn(old, logp, adv, mask, "token-mean", PolicyLossOptions(clip_cov_ratio=0.0))


def test_aliases_unknown_names_and_descriptions():
    assert get_policy_loss("clip-cov") is POLICY_LOSSES["clip_cov"]
    assert get_policy_loss("kl-cov") is POLICY_LOSSES["kl_cov"]
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*vanilla, gspo.*dppo_kl.*clip-cov"):
        get_policy_loss("ppo")
    names = [name for name, _ in describe_policy_losses()]
    assert names[:len(POLICY_LOSSES)] == list(POLICY_LOSSES)
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "sapo", "cispo", "gpg", "geo_mean", "clip_cov", "kl_cov",
                                  "dppo_tv", "dppo_kl", "dro", "bypass_mode"}
    assert dict(describe_policy_losses())["kl-cov"] == "alias of kl_cov"
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        get_policy_loss("cispo")(*loss_batch(0)[:4], "token-average")


def test_dro_needs_a_positive_beta():
    old, logp, adv, mask, _ = loss_batch(0)
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="dro_beta > 0"):
            get_policy_loss("dro")(old, logp, adv, mask, "token-mean", PolicyLossOptions(dro_beta=beta))
    # the penalty is in the loss: a larger beta, a larger loss for the same (non-zero) log-ratios
    small, _ = get_policy_loss("dro")(old, logp, adv, mask, "token-mean", PolicyLossOptions(dro_beta=0.1))
    large, _ = get_policy_loss("dro")(old, logp, adv, mask, "token-mean", PolicyLossOptions(dro_beta=1.0))
    assert large > small


BYPASS_CORRECTIONS = [
    RolloutCorrectionOptions(),  # plain PPO-clip against the rollout log-probs
    RolloutCorrectionOptions(loss_type="reinforce"),
    RolloutCorrectionOptions(loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0),
    RolloutCorrectionOptions(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="0.05_20.0"),
    RolloutCorrectionOptions(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.5_2.0",
                             rollout_is_batch_normalize=True),
    RolloutCorrectionOptions(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=5.0,
                             rollout_is_batch_normalize=True),
    *(RolloutCorrectionOptions(loss_type=loss_type, rollout_is="token", rollout_rs=option,
                               rollout_rs_threshold="0.3_3.0" if option.endswith("k1") else 0.4)
      for option in REJECTION_OPTIONS for loss_type in ("ppo_clip", "reinforce")),
    RolloutCorrectionOptions(loss_type="reinforce", rollout_is="token", rollout_rs="token_k1, seq_max_k2,token_k1",
                             rollout_rs_threshold="4.0,2.0"),
    RolloutCorrectionOptions(rollout_rs="seq_sum_k1", rollout_rs_threshold=3.0),  # k1 from one bound: 1/U .. U
]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("correction", BYPASS_CORRECTIONS, ids=lambda c: f"{c.loss_type}-{c.rollout_is}-"
                         f"{c.rollout_is_threshold}-{c.rollout_is_batch_normalize}-{c.rollout_rs}")
def test_bypass_mode_matches_verl(correction, mode):
    """Every weighting and rejection option of verl 0.9.1's bypass mode, in value, gradient and metrics; the
    rejection drops some but not all tokens, so a wrong mask would show."""
    options = dataclasses.replace(OPTIONS, rollout_correction=correction)
    for seed in (0, 1):
        ours, ref = ours_and_verl("bypass_mode", seed, mode, options=options, weighted=True)
        assert_same(ours, ref)
        assert ours[1].abs().sum() > 0
        if correction.rollout_rs is not None:
            old, logp, _, mask, _ = loss_batch(seed)
            kept = rollout_rejection_mask((logp - old).detach(), mask, correction.rollout_rs,
                                          correction.rollout_rs_threshold)
            assert 0 < kept.sum() < mask.sum() or seed == 1


def test_bypass_mode_refuses_what_verl_refuses():
    old, logp, adv, mask, _ = loss_batch(0)
    fn = get_policy_loss("bypass_mode")

    def run(**correction):
        options = dataclasses.replace(OPTIONS, rollout_correction=RolloutCorrectionOptions(**correction))
        return fn(old, logp, adv, mask, "token-mean", options)

    with pytest.raises(ValueError, match="loss_type"):
        run(loss_type="pg")
    with pytest.raises(ValueError, match="rollout_rs_threshold must be given"):
        run(rollout_rs="token_k2")
    with pytest.raises(ValueError, match="unknown rollout_rs"):
        run(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="single upper bound"):
        run(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0")
    with pytest.raises(ValueError, match="one threshold or 2"):
        run(rollout_rs="token_k2,token_k3", rollout_rs_threshold="1,2,3")
    with pytest.raises(ValueError, match="lower <= upper"):
        run(rollout_is="token", rollout_is_threshold="3.0_2.0")
    with pytest.raises(ValueError, match="rollout_is"):
        run(rollout_is="row")
    with pytest.raises(ValueError, match="dp_size > 1"):
        options = dataclasses.replace(OPTIONS, rollout_correction=RolloutCorrectionOptions(
            rollout_is="token", rollout_is_batch_normalize=True))
        fn(old, logp, adv, mask, "token-mean", options, global_num_tokens=40, dp_size=2)
