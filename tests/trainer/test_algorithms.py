"""Every advantage estimator and policy loss by name in the RL trainer: each runs two tiny steps in-process and
really changes the update (the batch's advantages through the `on_batch` seam, the trained weights); vanilla
is today's dual-clip objective bit for bit; clip_cov's random picks repeat on resume; and DP=2 runs with a
non-default loss, an estimator that whitens over the global batch, remax and on-policy distillation (sampled tokens and
top-k, the top-k also under sequence parallelism) equal the single process."""

import json

import pytest
import torch

from scalerl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    get_advantage_estimator,
    grpo_advantages,
    policy_loss,
)
from scalerl.algorithms.entropy import logprobs_from_logits
from scalerl.core.algorithm_names import NOT_YET_TRAINABLE
from scalerl.core.config import ConfigError, load_config
from scalerl.trainer.objectives import PolicyObjective, policy_loss_options
from scalerl.trainer.rl_trainer import RLTrainer, loss_draw_seed
from scalerl.verify import COMPARED_METRICS, TOLERANCE, max_metric_diff, max_weight_diff, run_kind, verification_overrides
from tests.spawned_group import run_in_group
from tests.tiny import save_tiny_teacher
from tests.trainer.conftest import TINY

# Losses whose first, on-policy mini-batch has vanilla's gradient would differ from it only slightly after;
# these make each loss act at once (clip_cov cuts 10% of the tokens, kl_cov penalises 10%).
LOSS_OPTIONS = {"clip_cov": ("actor.clip_cov_ratio=0.1", "actor.clip_cov_lb=0"), "kl_cov": ("actor.kl_cov_ratio=0.1",)}


def _two_steps(config):
    """Two RL steps of ``config``; (trainer, the first step's batch after its advantages, both steps' metrics)."""
    batches = []
    trainer = RLTrainer.from_config(config, on_batch=batches.append)
    metrics = [trainer.advance(), trainer.advance()]
    return trainer, batches[0], metrics


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}


@pytest.mark.parametrize("name", [n for n in ADVANTAGE_ESTIMATORS if n not in NOT_YET_TRAINABLE])
def test_each_estimator_trains_with_its_own_advantages(tiny_config, length_reward, name):
    overrides = ["algorithm.adv_estimator=" + name, "algorithm.gamma=0.9", "algorithm.lam=0.95", length_reward]
    trainer, batch, metrics = _two_steps(tiny_config(*overrides))
    assert all(v == v for m in metrics for v in m.values())  # no NaN anywhere
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    grpo, _ = grpo_advantages(batch.token_rewards(), batch.response_mask, batch.group_ids)
    if name == "grpo":
        assert torch.equal(batch.advantages, grpo)  # the default is today's estimator, bit for bit
        return
    if name == "grpo_vectorized":  # the same formula, vectorized
        assert torch.allclose(batch.advantages, grpo, atol=1e-5)
        return
    assert not torch.allclose(batch.advantages, grpo, atol=1e-3), "the estimator changed nothing"
    if name == "remax":  # returns - advantages = the greedy response's score, one per prompt
        baseline = (batch.returns - batch.advantages)[:, 0]
        assert torch.equal(baseline, baseline.view(-1, 4)[:, :1].expand(-1, 4).reshape(-1))
        assert metrics[0]["critic/reward_baseline/mean"] == pytest.approx(float(baseline.mean()), abs=1e-6)
        return
    inputs = AdvantageInputs(batch.token_rewards(), batch.response_mask, index=batch.group_ids, values=batch.values,
                             gamma=0.9, lam=0.95)
    expected, _ = get_advantage_estimator(name)(inputs)
    assert torch.equal(batch.advantages, expected)  # the named estimator, with algorithm.gamma / lam
    assert (trainer.critic is not None) == (name == "gae")


@pytest.fixture(scope="module")
def vanilla_weights(tmp_path_factory):
    """The weights after two vanilla steps with the same settings as the loss runs below."""
    out = tmp_path_factory.mktemp("vanilla")
    (out / "reward.py").write_text("def score(response, ground_truth):\n    return len(response) / 10\n")
    config = load_config(None, [*TINY, f"trainer.output_dir={out / 'run'}", f"data.reward={out / 'reward.py'}:score"])
    return _weights(_two_steps(config)[0])


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n not in NOT_YET_TRAINABLE])
def test_each_policy_loss_trains_and_logs_its_metrics(tiny_config, length_reward, vanilla_weights, name):
    trainer, _, metrics = _two_steps(tiny_config("actor.policy_loss=" + name, *LOSS_OPTIONS.get(name, ()),
                                                 length_reward))
    assert all(v == v for m in metrics for v in m.values())
    own = {f"actor/{k}" for k in POLICY_LOSSES[name].metric_names}
    assert own <= set(metrics[0]), own - set(metrics[0])
    assert not ({"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} - own) & set(metrics[0])
    weights = _weights(trainer)
    same = all(torch.equal(weights[k], vanilla_weights[k]) for k in weights)
    assert same == (name == "vanilla"), "the loss did not change the update" if same else "vanilla moved"


def test_vanilla_is_the_dual_clip_objective_bit_for_bit(tiny_config):
    cfg = tiny_config("actor.clip_ratio_high=0.28", "actor.clip_ratio_c=2.5", "actor.loss_agg_mode=seq-mean-token-sum")
    a = cfg.actor
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)  # prompt position + 6 response positions
    ids, mask = torch.randint(0, 11, (3, 6)), (torch.rand(3, 6) > 0.2).float()
    old, adv, weights = torch.randn(3, 6) * 0.1 - 2.4, torch.randn(3, 6), torch.rand(3, 6) + 0.5
    target = torch.stack([ids.float(), mask, old, adv, torch.zeros(3, 6), weights], dim=-1)
    counts = {"global_num_tokens": mask.sum() * 2, "global_num_seqs": torch.tensor(6.0), "dp_size": 2, "horizon": 6}

    objective = PolicyObjective(a, 1.0, POLICY_LOSSES["vanilla"], policy_loss_options(a))
    objective.start_mini_batch(counts)
    loss = objective(logits, target)
    (grad,) = torch.autograd.grad(loss, logits)
    # What the objective computed before the registry: `policy_loss` with the actor's dual-clip keys.
    logp = logprobs_from_logits(logits[:, :-1].float(), ids)
    before, _ = policy_loss(old, logp, adv, mask, clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high,
                            clip_c=a.clip_ratio_c, agg=a.loss_agg_mode, **counts, token_weights=weights)
    (grad_before,) = torch.autograd.grad(before, logits)
    assert torch.equal(loss, before) and torch.equal(grad, grad_before)


def test_clip_cov_picks_repeat_on_resume(tiny_config, length_reward, tmp_path):
    chosen = ("actor.policy_loss=clip_cov", *LOSS_OPTIONS["clip_cov"], length_reward)
    straight = RLTrainer.from_config(tiny_config(*chosen, "trainer.total_steps=2", f"trainer.output_dir={tmp_path / 'a'}"))
    straight.fit()
    RLTrainer.from_config(tiny_config(*chosen, "trainer.total_steps=1", "trainer.save_every=1",
                                      f"trainer.output_dir={tmp_path / 'b'}")).fit()
    resumed = RLTrainer.from_config(tiny_config(*chosen, "trainer.total_steps=2", "trainer.resume=auto",
                                                f"trainer.output_dir={tmp_path / 'b'}"))
    torch.rand(100)  # the global generator's state must not matter
    resumed.fit()
    for (name, a), (_, b) in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["actor/pg_clipfrac"] > 0  # tokens were cut
    assert len({loss_draw_seed(0, step, rank) for step in range(50) for rank in range(8)}) == 400


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=ppo", r"algorithm.adv_estimator must be one of gae, grpo, .*remax, rloo"),
    ("actor.policy_loss=ppo2", r"actor.policy_loss must be one of vanilla, gspo, .*dppo_kl.*clip-cov, kl-cov"),
    ("algorithm.adv_estimator=rloo rollout.n=1", r"rollout.n must be >= 2 when algorithm.adv_estimator is 'rloo'"),
    ("algorithm.adv_estimator=remax rollout.temperature=0", r"advantage of algorithm.adv_estimator=remax is 0"),
    ("actor.clip_cov_lb=6", r"actor.clip_cov_lb \(6.0\) must be below actor.clip_cov_ub \(5.0\)"),
])
def test_wrong_algorithm_settings_fail_at_config_time(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


def test_estimators_without_groups_take_one_sample_per_prompt():
    for name in ("reinforce_plus_plus", "gae", "remax"):
        assert load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n=1",
                                  "actor.ppo_mini_batch_size=16"]).rollout.n == 1


# The DP=2 comparison: gspo on GRPO's advantages, REINFORCE++-baseline's whitening over the global batch
# (all-reduced) and remax's greedy baselines (each rank generates its share) under vanilla; `scalerl verify`'s overrides, compared as `scalerl verify` compares, but for
# the first on-policy pg_loss: with these advantages it is 0 up to rounding (a sequence mean of group-centred
# scores, a token mean of whitened returns), nothing to compare relatively.
DP_METRICS = tuple(k for k in COMPARED_METRICS["grpo"] if k != "actor/pg_loss")
# ... and on-policy distillation (its metrics all-reduced), with the task reward added, from a teacher saved in
# the test's directory ({out}): the sampled tokens' reverse KL, and the top-k forward KL (a loss term over the
# teacher's stored top-k, aggregated over the global mini-batch's tokens).
DP_RUNS = {"gspo": ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
           "rpp_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
           "remax": ["algorithm.adv_estimator=remax"],
           "distill": ["algorithm.distill.teacher={out}/teacher", "algorithm.distill.task_weight=1.0"],
           "distill_topk": ["algorithm.distill.teacher={out}/teacher", "algorithm.distill.task_weight=1.0",
                            "algorithm.distill.top_k=4"]}
DP_DISTILL_METRICS = {"distill": ("distill/reverse_kl",),
                      "distill_topk": ("distill/reverse_kl", "distill/teacher_mass", "actor/distill_topk_kl")}
# Top-k distillation under Ulysses sp=2 (world 2, one replica whose sequences are split over both ranks, padded and
# packed rows): each rank takes the teacher's top-k and the student's KL at its own positions, only those
# gathered; against the same single process as distill_topk (its name: the reference run).
SP_RUNS = {"distill_topk_sp2": ("distill_topk", ["parallel.dp_replicate=1", "parallel.sp=2"]),
           "distill_topk_sp2_packed": ("distill_topk", ["parallel.dp_replicate=1", "parallel.sp=2",
                                                        "actor.use_remove_padding=true"])}


def _dp_overrides(extra, out_dir):
    return [o.format(out=out_dir) for o in extra]


def _dp_rank(rank, out_dir):
    for name, extra in DP_RUNS.items():
        run_kind("grpo", [*verification_overrides(2), *_dp_overrides(extra, out_dir), "parallel.dp_replicate=2"],
                 out_dir / "dp2" / name)
    for name, (reference, layout) in SP_RUNS.items():
        run_kind("grpo", [*verification_overrides(2), *_dp_overrides(DP_RUNS[reference], out_dir), *layout],
                 out_dir / "dp2" / name)


def test_data_parallel_runs_equal_the_single_process(tmp_path):
    save_tiny_teacher(tmp_path / "teacher", 7, *verification_overrides(2))
    singles = {name: run_kind("grpo", [*verification_overrides(2), *_dp_overrides(extra, tmp_path)],
                              tmp_path / "single" / name)
               for name, extra in DP_RUNS.items()}
    run_in_group(_dp_rank, 2, tmp_path)
    pairs = [(name, name) for name in singles] + [(name, reference) for name, (reference, _) in SP_RUNS.items()]
    for name, reference in pairs:
        single = singles[reference]
        rows = [[r for r in map(json.loads, (tmp_path / run / run_name / "metrics.jsonl").read_text().splitlines())
                 if r["step"] > 0] for run, run_name in (("single", reference), ("dp2", name))]
        assert len(rows[1]) == 2
        distilled = DP_DISTILL_METRICS.get(reference, ())
        compared = DP_METRICS + distilled
        # max_metric_diff skips a key the runs lack: both must have distilled (and trained on the top-k term)
        assert all(key in r for key in distilled for run in rows for r in run), name
        if reference == "distill_topk":
            assert all(r["actor/distill_topk_kl"] > 0 for run in rows for r in run)
        assert max_metric_diff(*rows, compared) <= TOLERANCE, name
        assert max_weight_diff(single, tmp_path / "dp2" / name / "final") <= TOLERANCE, name


@pytest.mark.parametrize("name", sorted(NOT_YET_TRAINABLE))
def test_a_name_the_trainer_cannot_feed_yet_is_refused_with_what_is_missing(name):
    """verl 0.9.1's entries whose inputs the trainer does not give yet: a run naming one fails at the config,
    saying what is missing, instead of failing mid-step (or, for bypass_mode, silently training vanilla)."""
    key = "algorithm.adv_estimator" if name in ADVANTAGE_ESTIMATORS else "actor.policy_loss"
    with pytest.raises(ConfigError, match=f"{key}={name} is in scalerl.algorithms .* does not give it"):
        load_config(None, [f"{key}={name}"])
