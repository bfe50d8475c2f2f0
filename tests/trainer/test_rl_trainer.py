"""The RL trainer end to end on the tiny built-in model: metrics, estimators, precisions, bitwise resume."""

import json

import pytest
import torch

from scalerl.checkpoint import CheckpointError
from scalerl.trainer.rl_trainer import RLTrainer, train

EXPECTED_METRICS = [
    "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor",
    "timing_s/update_weights", "timing_s/step", "perf/throughput", "perf/total_num_tokens", "perf/time_per_step",
    "perf/mfu", "perf/max_memory_gb", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
    "actor/grad_norm", "actor/lr", "critic/score/mean", "critic/score/max", "critic/score/min",
    "response_length/mean", "response_length/max", "response_length/clip_ratio", "reward/num_failures",
]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_grpo_run_writes_metrics_model_and_plot(tiny_config):
    cfg = tiny_config("trainer.eval_every=2", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01")
    summary = train(cfg)
    out = cfg.trainer.output_dir
    rows = _lines(__import__("pathlib").Path(out) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in EXPECTED_METRICS + ["timing_s/ref", "actor/kl_loss"]:
        assert key in rows[1], key
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2] and "val/accuracy" in rows[3]
    assert 0 < rows[1]["perf/mfu"] < 1
    assert rows[1]["perf/total_num_tokens"] > 0
    assert (__import__("pathlib").Path(summary["final_model"]) / "model.safetensors").is_file()
    assert summary["plot"].endswith("metrics.png")


def test_gae_estimator_trains_a_critic(tiny_config, length_reward):
    trainer = RLTrainer.from_config(tiny_config("algorithm.adv_estimator=gae", "algorithm.lam=0.95", length_reward))
    critic_before = {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}
    metrics = trainer.train_step()
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= set(metrics)
    changed = any(not torch.equal(v, trainer.critic.model.state_dict()[k]) for k, v in critic_before.items())
    assert changed
    # Gradients are freed after each optimizer step: none held through generation and the next step (they
    # were a whole model's worth of host memory, kept until the next update's zero_grad).
    held = [n for m in (trainer.policy.model, trainer.critic.model) for n, p in m.named_parameters()
            if p.grad is not None]
    assert not held, held[:3]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_are_finite(tiny_config, length_reward, precision):
    trainer = RLTrainer.from_config(tiny_config(f"trainer.precision={precision}", length_reward))
    before = trainer.policy.model.layers[0].mlp.up_proj.weight.clone()
    metrics = trainer.train_step()
    assert all(v == v for v in metrics.values())  # no NaN
    assert trainer.policy.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # master weights stay fp32
    if precision == "bf16":
        assert not torch.equal(before, trainer.policy.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("precision, engine_args, recomputed", [
    ("bf16", [], False),  # CPU: the engine decodes by the autocast forward's recipe
    ("fp32", [], False),
    ("bf16", ["rollout.max_num_seqs=2"], True),  # continuous batching decodes in the parameters' fp32
])
def test_old_logprobs_are_recomputed_only_where_the_engine_computes_otherwise(
        tiny_config, length_reward, monkeypatch, precision, engine_args, recomputed):
    from scalerl.trainer import rl_step

    calls = []
    real = rl_step.response_logprobs
    monkeypatch.setattr(rl_step, "response_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer = RLTrainer.from_config(tiny_config(f"trainer.precision={precision}", *engine_args, length_reward))
    batches = []
    trainer.on_batch = batches.append
    metrics = trainer.train_step()
    assert bool(calls) == recomputed and ("rollout/logprob_diff/mean" in metrics) == recomputed
    assert torch.equal(batches[0].old_logprobs, batches[0].rollout_logprobs) != recomputed


def test_resume_is_bitwise_identical(tiny_config, length_reward, tmp_path):
    straight = RLTrainer.from_config(tiny_config("trainer.total_steps=4", length_reward, f"trainer.output_dir={tmp_path / 'a'}"))
    straight.fit()
    first = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=2", "trainer.save_every=2", length_reward, f"trainer.output_dir={tmp_path / 'b'}"
    ))
    first.fit()
    resumed = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=4", "trainer.resume=auto", length_reward, f"trainer.output_dir={tmp_path / 'b'}"
    ))
    assert resumed.step == 2
    resumed.fit()
    for (name, a), (_, b) in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    initial = RLTrainer.from_config(tiny_config(length_reward, f"trainer.output_dir={tmp_path / 'x'}")).policy.model.state_dict()
    assert not torch.equal(initial["embed_tokens.weight"], straight.policy.model.state_dict()["embed_tokens.weight"])
    a_rows, b_rows = _lines(tmp_path / "a" / "metrics.jsonl"), _lines(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b_rows] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a_rows[1:], b_rows[1:]):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "actor/entropy"):
            assert ra[key] == rb[key], (ra["step"], key)


def test_resume_with_a_different_model_is_refused(tiny_config, tmp_path):
    RLTrainer.from_config(tiny_config("trainer.total_steps=1", f"trainer.output_dir={tmp_path / 'c'}")).fit()
    with pytest.raises(CheckpointError, match="model.hidden_size"):
        RLTrainer.from_config(tiny_config("trainer.resume=auto", "model.hidden_size=64", "model.intermediate_size=64",
                              f"trainer.output_dir={tmp_path / 'c'}"))


def test_failing_user_reward_is_counted_not_fatal(tiny_config, tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def score(response, ground_truth):\n"
        "    if '#' in response:\n"
        "        raise RuntimeError('boom')\n"
        "    return 'not a number'\n"
    )
    trainer = RLTrainer.from_config(tiny_config(f"data.reward={reward_file}:score"))
    metrics = trainer.train_step()
    assert metrics["reward/num_failures"] == 16  # every sample failed, scored 0, and the step completed
    assert metrics["critic/score/mean"] == 0.0


def test_too_long_prompt_names_the_setting(tiny_config):
    with pytest.raises(ValueError, match="training row 1: .* data.max_prompt_length=4"):  # at start, not mid-run
        RLTrainer.from_config(tiny_config("data.max_prompt_length=4"))


def test_token_budget_micro_batches_in_the_trainer(tiny_config, length_reward):
    fixed = RLTrainer.from_config(tiny_config(length_reward, "trainer.total_steps=2"))
    fixed.fit()
    budget = RLTrainer.from_config(tiny_config(length_reward, "trainer.total_steps=2", "actor.micro_batch_max_tokens=40",
                                   f"trainer.output_dir={fixed.output_dir}-budget"))
    budget.fit()
    # Other micro-batch shapes sum the gradients in another order: 1.6e-6 apart after two Adam steps on an
    # AVX2-only EPYC at two threads (the matmul's thread split follows the shape), 1e-6 or less on AVX-512.
    for (name, a), (_, b) in zip(fixed.policy.model.state_dict().items(), budget.policy.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_fp16_checkpoint_keeps_the_loss_scale(tiny_config, length_reward, tmp_path):
    first = RLTrainer.from_config(tiny_config("trainer.precision=fp16", "trainer.total_steps=1", length_reward,
                                  f"trainer.output_dir={tmp_path}"))
    first.scaler._init_scale = 1234.0  # a scale no fresh scaler starts from
    first.fit()
    assert first.scaler.get_scale() in (1234.0, 617.0)  # kept, or halved after an overflow
    assert (tmp_path / "checkpoints" / "step_00000001" / "grad_scaler.pt").is_file()
    resumed = RLTrainer.from_config(tiny_config("trainer.precision=fp16", "trainer.total_steps=2", "trainer.resume=auto",
                                    length_reward, f"trainer.output_dir={tmp_path}"))
    assert resumed.scaler.get_scale() == first.scaler.get_scale()


def test_continuous_batching_rollouts_train_as_the_fixed_batch(tiny_config, length_reward, tmp_path):
    """rollout.max_num_seqs below the step's 16 rollouts: the trainer's engine batches them continuously, with
    the fixed batch's samples, so the run's scores and losses are the same."""
    runs = []
    for max_num_seqs in (0, 3):
        cfg = tiny_config(length_reward, f"rollout.max_num_seqs={max_num_seqs}",
                          f"trainer.output_dir={tmp_path / str(max_num_seqs)}")
        train(cfg)
        runs.append(_lines(__import__("pathlib").Path(cfg.trainer.output_dir) / "metrics.jsonl"))
    steps = [(f, c) for f, c in zip(*runs) if "actor/pg_loss" in f]
    assert len(steps) >= 2 and len(runs[0]) == len(runs[1])
    for fixed, continuous in steps:
        for key in ("critic/score/mean", "response_length/mean"):
            assert continuous[key] == fixed[key], key
        assert abs(continuous["actor/pg_loss"] - fixed["actor/pg_loss"]) < 1e-5


@pytest.mark.parametrize("speedup, chosen, extra", [
    (3.0, "bf16", []), (1.1, "fp32", []),
    # The update would gain, but continuous batching's fp32 decode would add the old-log-prob pass: the step not.
    (3.0, "fp32", ["rollout.max_num_seqs=2"]),
])
def test_precision_auto_is_chosen_at_start_said_and_written_back(tiny_config, length_reward, capsys, monkeypatch,
                                                                 speedup, chosen, extra):
    from scalerl.perf import precision

    monkeypatch.setattr(precision, "bf16_hardware", lambda device: "avx512_bf16")
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device, rows, inner, outer: speedup)
    monkeypatch.setattr(precision, "AUTO_MIN_MLP_FLOPS", 0)  # the test model is tinier than auto's bf16 size
    trainer = RLTrainer.from_config(tiny_config("trainer.precision=auto", *extra, length_reward))
    assert trainer.cfg.trainer.precision == chosen and trainer.autocast.precision == chosen
    said = capsys.readouterr().out
    assert f"trainer.precision=auto: {chosen} (bf16 ran this model's MLP matmul" in said
    assert ("but continuous batching (rollout.max_num_seqs)" in said) == bool(extra)
    assert trainer.engine.logprobs_match_training_forward == (chosen == "fp32" or not extra)
    assert trainer.monitor.context["bf16_over_fp32"] == speedup  # the doctor's compute/precision evidence


def test_bf16_on_a_cpu_without_bf16_instructions_trains_and_says_so_once(tiny_config, length_reward, capsys,
                                                                       monkeypatch):
    """With the CPU's bf16 paths switched off (as on an AVX2-only CPU), trainer.precision=bf16 trains, its
    engine decodes on plain bf16 weights, and one line at start says it is slower than fp32 here and why."""
    monkeypatch.setenv("SCALERL_CPU_ISA", "avx2")
    trainer = RLTrainer.from_config(tiny_config("trainer.precision=bf16", "trainer.total_steps=1", length_reward))
    said = capsys.readouterr().out
    assert said.count("trainer.precision=bf16: as configured, but this CPU") == 1
    assert "no bf16 matmul instructions" in said and "SCALERL_CPU_ISA=avx2" in said
    trainer.fit()
    layer = trainer.engine.decode_model.layers[0]
    assert layer.gate_up.weight.dtype == torch.bfloat16 and not layer.gate_up.onednn


def test_standalone_evaluation_decodes_the_weights_the_optimizer_wrote():
    """Standalone, no weight sync refreshes the trainer's own engine, and fused optimizer updates leave no
    trace its stale check sees: evaluation must lay the current weights out itself (it decoded the first
    step's weights before)."""
    from types import SimpleNamespace

    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams
    from tests.tiny import tiny_model

    model = tiny_model(seed=0).eval()
    engine = BuiltinEngine(model, pad_token_id=0)
    engine.refresh_weights()  # the layout of the starting weights, as the first generation makes it
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, seed=0)
    before = engine.generate([[3, 4, 5]], greedy).response_ids
    # An optimizer step as the trainer's takes it: fused AdamW writes in place without bumping the parameters'
    # version counters, so the engine's own stale check cannot see it.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    fresh = BuiltinEngine(tiny_model(seed=0).eval(), pad_token_id=0)
    fresh.model.load_state_dict(model.state_dict())
    expected = fresh.generate([[3, 4, 5]], greedy).response_ids
    assert not torch.equal(before, expected)  # the change is visible in greedy tokens
    assert torch.equal(engine.generate([[3, 4, 5]], greedy).response_ids, before)  # stale without a refresh
    single_turn = SimpleNamespace(rollout=SimpleNamespace(agent=SimpleNamespace(env=None)))
    trainer = SimpleNamespace(rollouts=object(), engine=engine, cfg=single_turn)  # standalone: not ColocatedRollouts
    got = RLTrainer.engine_with_current_weights(trainer).generate([[3, 4, 5]], greedy).response_ids
    assert torch.equal(got, expected)
