"""The RL step's reward shaping and sampled evaluation, each in tiny in-process runs: DAPO's overlong buffer
moves the scores by exactly its penalty, TRL's truncation mask drops exactly the truncated responses from the
loss, KL in the reward gives verl's advantages with the fixed and the adaptive coefficient (whose value a
resumed run carries on), pass@n / mean@n / maj@n per data source with the same keys and values however the
set is split over ranks (and in a DP=2 run); every one is off by default, bit for bit."""

import json

import pytest
import torch

from scalerl.algorithms import AdvantageInputs, get_advantage_estimator
from scalerl.algorithms.dapo import overlong_penalty
from scalerl.algorithms.pass_at_k import sampled_eval_metrics
from scalerl.core.config import ConfigError, load_config
from scalerl.data.sources import reward_from_config
from scalerl.trainer.evaluation import evaluate_sampled
from scalerl.trainer.reward_shaping import truncated_rows
from scalerl.trainer.rl_trainer import RLTrainer
from scalerl.trainer.update import UpdateRun
from scalerl.verify import (
    TOLERANCE,
    max_metric_diff,
    max_weight_diff,
    run_kind,
    verification_overrides,
)
from tests.algorithms import verl_reference as verl
from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

# Two steps with a moving policy (step 2's KL to the reference is not 0), a reward that varies in a group.
BASE = ("actor.lr=1e-3", "actor.ppo_mini_batch_size=8", "data.num_val=0")


@pytest.fixture
def run(tmp_path):
    """``run(*overrides)``: a tiny trainer's two steps; (trainer, both steps' batches, both steps' metrics)."""
    reward = tmp_path / "parity_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response) % 2)\n")
    count = [0]

    def two_steps(*overrides, steps=2):
        count[0] += 1
        cfg = load_config(None, tiny_overrides(*BASE, f"data.reward={reward}:score",
                                               f"trainer.output_dir={tmp_path / str(count[0])}", *overrides))
        batches = []
        trainer = RLTrainer.from_config(cfg, on_batch=lambda b: batches.append(b.select(torch.arange(len(b)))))
        metrics = []
        for _ in range(steps):
            metrics.append(trainer.advance())
        return trainer, batches, metrics

    return two_steps


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}


def _same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_every_extra_is_off_by_default_and_inert_at_zero_strength(run):
    default, batches, metrics = run()
    assert default.reference is None and default.shaping.state_dict() == {}
    assert not any(k.startswith(("reward/overlong", "actor/reward_kl", "val/")) for m in metrics for k in m)
    inert = ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4",
             "algorithm.overlong_buffer.penalty_factor=0", "algorithm.use_kl_in_reward=true",
             "algorithm.kl_ctrl.kl_coef=0"]
    zero, zero_batches, _ = run(*inert)
    assert zero.reference is not None  # KL in the reward builds the reference model
    assert _same_weights(_weights(default), _weights(zero))
    assert torch.equal(batches[1].advantages, zero_batches[1].advantages)


def test_overlong_buffer_adds_its_penalty_to_the_scores(run):
    plain, plain_batches, _ = run(steps=1)
    shaped, batches, metrics = run("algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4",
                                   "algorithm.overlong_buffer.penalty_factor=0.5", steps=1)
    lengths = plain_batches[0].response_mask.sum(-1)
    penalty = overlong_penalty(lengths, 8, 4, 0.5).float()
    assert torch.equal(batches[0].response_mask, plain_batches[0].response_mask)  # the same rollouts
    assert (penalty < 0).any()
    assert torch.allclose(batches[0].scores, plain_batches[0].scores + penalty)
    assert metrics[0]["reward/overlong_penalty/mean"] == pytest.approx(float(penalty.mean()))
    assert metrics[0]["critic/score/mean"] == pytest.approx(float((plain_batches[0].scores + penalty).mean()))
    assert not _same_weights(_weights(plain), _weights(shaped))


def test_overlong_buffer_len_is_checked_against_the_response_limit():
    with pytest.raises(ConfigError, match="overlong_buffer.len must be in"):
        load_config(None, tiny_overrides("algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=9"))


def test_mask_truncated_completions_drops_exactly_the_truncated_responses(run, monkeypatch):
    plain, plain_batches, _ = run(steps=1)
    updated = []  # the batches the updates train on

    finish = UpdateRun.finish

    def spy(update, batch):
        updated.append(batch.select(torch.arange(len(batch))))
        return finish(update, batch)

    monkeypatch.setattr(UpdateRun, "finish", spy)
    masked, batches, metrics = run("actor.mask_truncated_completions=true", steps=1)
    before, after = plain_batches[0], updated[0]
    assert torch.equal(batches[0].response_mask, before.response_mask)  # the same rollouts, seen unmasked
    assert metrics[0]["perf/total_num_tokens"] == float(before.attention_mask.sum())  # generated tokens count
    truncated = before.response_mask.sum(-1) == 8  # the tiny run's rollout.max_new_tokens, no stop token within
    stop_ids = masked.tokenizer.stop_token_ids
    truncated &= ~torch.isin(before.response_ids.gather(1, (before.response_mask.sum(-1).long() - 1)[:, None])[:, 0],
                             torch.tensor(stop_ids))
    assert truncated.any() and (~truncated).any()
    assert torch.equal(truncated_rows(before, 8, stop_ids), truncated)
    assert torch.equal(after.response_mask[truncated], torch.zeros_like(after.response_mask[truncated]))
    assert torch.equal(after.response_mask[~truncated], before.response_mask[~truncated])
    assert torch.equal(after.advantages, before.advantages)  # the advantages still see every response
    assert not _same_weights(_weights(plain), _weights(masked))


def _verl_advantages(batch, controller):
    """verl's apply_kl_penalty (the transcription) and GRPO on the captured batch."""
    rewards, metrics = verl.apply_kl_penalty(batch.token_rewards(), batch.old_logprobs, batch.ref_logprobs,
                                             batch.response_mask, controller, "kl")
    advantages, _ = get_advantage_estimator("grpo")(AdvantageInputs(rewards, batch.response_mask, index=batch.group_ids))
    return advantages, metrics["actor/reward_kl_penalty"]


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_kl_in_the_reward_equals_verl(run, kind):
    coef, horizon = 0.5, 64
    _, batches, metrics = run("algorithm.use_kl_in_reward=true", f"algorithm.kl_ctrl.type={kind}",
                              f"algorithm.kl_ctrl.kl_coef={coef}", f"algorithm.kl_ctrl.horizon={horizon}",
                              "algorithm.kl_ctrl.target_kl=0.01")
    # Step 1: the policy is the reference; the old log-probs are the engine's, whose fused decode layout
    # rounds differently from the reference's forward (equal to ~1e-8, not bitwise).
    assert abs(metrics[0]["actor/reward_kl_penalty"]) < 1e-6
    batch = batches[1]
    assert not torch.equal(batch.old_logprobs, batch.ref_logprobs)
    # The coefficient at step 2: adaptive moved it once, by clip(0 / target - 1) = -0.2 over 16 sequences.
    beta = coef * (1 - 0.2 * 16 / horizon) if kind == "adaptive" else coef
    assert metrics[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-12)
    controller = (verl.AdaptiveKLController(beta, 0.01, horizon) if kind == "adaptive"
                  else verl.FixedKLController(beta))
    expected, current_kl = _verl_advantages(batch, controller)
    assert torch.allclose(batch.advantages, expected, atol=1e-6)
    assert metrics[1]["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-5)
    plain_advantages, _ = get_advantage_estimator("grpo")(
        AdvantageInputs(batch.token_rewards(), batch.response_mask, index=batch.group_ids))
    assert not torch.allclose(batch.advantages, plain_advantages, atol=1e-4)


def test_adaptive_kl_coefficient_survives_resume(tmp_path, run):
    reward = tmp_path / "parity_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response) % 2)\n")
    chosen = [*BASE, f"data.reward={reward}:score", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
              "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_ctrl.horizon=32", "algorithm.kl_ctrl.target_kl=0.01"]

    def trainer(out, *extra):
        return RLTrainer.from_config(load_config(None, tiny_overrides(*chosen, f"trainer.output_dir={tmp_path / out}",
                                                                      *extra)))

    straight = trainer("a", "trainer.total_steps=3")
    straight.fit()
    trainer("b", "trainer.total_steps=2", "trainer.save_every=2").fit()
    (checkpoint,) = (tmp_path / "b" / "checkpoints").glob("step_*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["kl_ctrl"]["value"] != 0.5
    resumed = trainer("b", "trainer.total_steps=3", "trainer.resume=auto")
    assert resumed.step == 2 and resumed.shaping.kl_controller.value == state["kl_ctrl"]["value"]
    resumed.fit()
    assert resumed.shaping.kl_controller.value == straight.shaping.kl_controller.value
    assert _same_weights(_weights(straight), _weights(resumed))
    rows = [[json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()] for out in "ab"]
    assert rows[0][-1]["step"] == rows[1][-1]["step"] == 3
    for key in ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "actor/pg_loss"):
        assert rows[0][-1][key] == rows[1][-1][key], key


# --- sampled evaluation --------------------------------------------------------------------------------

# Uneven data sources: five "alpha" rows then three "beta" rows, so a DP=2 split gives rank 0 only alpha.
VAL_ROWS = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "data_source": source}
            for a, b, source in [(1, 2, "alpha"), (2, 2, "alpha"), (3, 4, "alpha"), (5, 1, "alpha"), (6, 2, "alpha"),
                                 (1, 1, "beta"), (4, 4, "beta"), (2, 5, "beta")]]


class ScriptedEngine:
    """Answers sample ``g`` of the whole set (its global row) with ``"9" * (1 + g % 3)`` (+ ``"7"`` when g % 5
    is 0): the samples depend only on their place in the set, as the built-in engine's do."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @staticmethod
    def text(g):
        return "9" * (1 + g % 3) + ("7" if g % 5 == 0 else "")

    def generate(self, prompts, sampling):
        from scalerl.rollout.engines.engine import GenerationOutput, left_pad

        texts = [self.text(sampling.row_offset + i) for i in range(len(prompts))]
        ids = [self.tokenizer.encode(t) for t in texts]
        width = max(map(len, ids))
        response = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in ids])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
        prompt_ids, prompt_mask = left_pad(prompts, self.tokenizer.pad_token_id)
        return GenerationOutput(prompt_ids, prompt_mask, response, mask, torch.zeros(mask.shape), ["stop"] * len(ids))


@pytest.fixture
def val_file(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in VAL_ROWS))
    return path


def _parity_reward(tmp_path):
    reward = tmp_path / "parity_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response) % 2)\n")
    return reward_from_config(load_config(None, [f"data.reward={reward}:score"]).data)


def test_sampled_evaluation_is_sampled_eval_metrics_over_the_whole_set_however_split(tmp_path):
    from scalerl.models.tokenizer import CharTokenizer

    tokenizer, reward, n = CharTokenizer(), _parity_reward(tmp_path), 4
    engine = ScriptedEngine(tokenizer)

    def evaluate(rows, offset, all_reduce=None):
        return evaluate_sampled(engine, tokenizer, rows, reward, 8, n, 1.0, ["alpha", "beta"],
                                "arithmetic", row_offset=offset, total_rows=len(VAL_ROWS), batch_size=8,
                                all_reduce=all_reduce)

    whole = evaluate(VAL_ROWS, 0)
    texts = [engine.text(g) for g in range(len(VAL_ROWS) * n)]
    scores = [float(len(t) % 2) for t in texts]
    rows = [row for row in VAL_ROWS for _ in range(n)]
    expected = sampled_eval_metrics([r["data_source"] for r in rows], [g // n for g in range(len(texts))], scores,
                                    [s >= 1 for s in scores], k=n, predictions=texts)
    expected.update({f"val/{name}@{n}": sum(expected[f"val/{s}/{name}@{n}"] * c for s, c in (("alpha", 5), ("beta", 3))) / 8
                     for name in ("pass", "mean", "maj")})
    assert whole.keys() == expected.keys() and all(whole[k] == pytest.approx(expected[k], abs=1e-12) for k in whole)
    assert 0 < whole["val/alpha/pass@4"] and whole["val/alpha/mean@4"] != whole["val/beta/mean@4"]
    # Two DP shares (rank 0 has no beta row): the SUM all-reduce of their sums gives the same keys and values.
    shares = [(VAL_ROWS[:4], 0), (VAL_ROWS[4:], 4)]
    sent = []
    for rows_, offset in shares:
        evaluate(rows_, offset, all_reduce=lambda t: sent.append(t.clone()) or t)
    total = sent[0] + sent[1]
    for rows_, offset in shares:
        split = evaluate(rows_, offset, all_reduce=lambda t: total.clone())
        assert split.keys() == whole.keys() and all(split[k] == pytest.approx(whole[k], abs=1e-12) for k in whole)


def _val_trainer(out, val_file, tmp_path, *extra):
    reward = tmp_path / "parity_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response) % 2)\n")
    return RLTrainer.from_config(load_config(None, tiny_overrides(
        f"data.val_files=[{val_file}]", f"data.reward={reward}:score", "rollout.val_temperature=1.0",
        f"trainer.output_dir={out}", *extra)))


def test_val_n_adds_pass_mean_maj_per_data_source_next_to_the_accuracy(tmp_path, val_file):
    plain = _val_trainer(tmp_path / "plain", val_file, tmp_path).evaluate()
    trainer = _val_trainer(tmp_path / "sampled", val_file, tmp_path, "trainer.val_n=4")
    sampled = trainer.evaluate()
    assert trainer.val_sources == ["alpha", "beta"]
    assert set(sampled) - set(plain) == {f"val/{s}{m}@4" for s in ("", "alpha/", "beta/") for m in ("pass", "mean", "maj")}
    assert all(sampled[k] == plain[k] for k in plain)  # val/accuracy and the rest unchanged
    assert sampled["val/mean@4"] == pytest.approx((5 * sampled["val/alpha/mean@4"] + 3 * sampled["val/beta/mean@4"]) / 8)
    assert all(sampled[f"val/{s}mean@4"] <= sampled[f"val/{s}pass@4"] for s in ("", "alpha/", "beta/"))
    with pytest.raises(ConfigError, match="trainer.val_n=4 samples per prompt at rollout.val_temperature=0"):
        load_config(None, ["trainer.val_n=4"])


def _dp_evaluate(rank, out, val_file, tmp_path):
    return _val_trainer(out, val_file, tmp_path, "trainer.val_n=4", "parallel.dp_replicate=2").evaluate()


def test_sampled_evaluation_under_dp2_equals_the_single_process(tmp_path, val_file):
    single = _val_trainer(tmp_path / "single", val_file, tmp_path, "trainer.val_n=4").evaluate()
    ranks = run_in_group(_dp_evaluate, 2, tmp_path / "dp2", val_file, tmp_path)
    for metrics in ranks:  # rank 0's share has no beta row: same keys, the whole set's values
        assert metrics.keys() == single.keys()
        assert all(metrics[k] == pytest.approx(single[k], abs=1e-9) for k in single), {k: (metrics[k], single[k]) for k in single}



# Every shaping option at once, the adaptive coefficient moving fast: its KL and n_steps are the global batch's.
SHAPED = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.5",
          "algorithm.kl_ctrl.horizon=64", "algorithm.kl_ctrl.target_kl=0.01", "algorithm.overlong_buffer.enable=true",
          "algorithm.overlong_buffer.len=4", "actor.mask_truncated_completions=true", "trainer.total_steps=3"]
SHAPED_METRICS = ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "reward/overlong_penalty/mean",
                  "critic/score/mean", "actor/grad_norm", "actor/entropy")


def _dp_shaped(rank, out):
    run_kind("grpo", [*verification_overrides(3), *SHAPED, "parallel.dp_replicate=2"], out)


def test_reward_shaping_under_dp2_equals_the_single_process(tmp_path):
    single = run_kind("grpo", [*verification_overrides(3), *SHAPED], tmp_path / "single")
    run_in_group(_dp_shaped, 2, tmp_path / "dp2")
    rows = [[r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
            for run in ("single", "dp2")]
    assert len(rows[1]) == 3 and rows[0][-1]["actor/reward_kl_penalty_coeff"] != 0.5
    assert rows[0][-1]["reward/overlong_penalty/mean"] < 0
    assert max_metric_diff(*rows, SHAPED_METRICS) <= TOLERANCE
    assert max_weight_diff(single, tmp_path / "dp2" / "final") <= TOLERANCE
