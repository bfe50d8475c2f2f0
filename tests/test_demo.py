"""The demo pipeline end to end at toy size (the real demo's numbers are measured in the README)."""

import json

from scalerl.cli import DEMO_CONFIG, main
from scalerl.core.config import load_config
from scalerl.data.arithmetic import count_arithmetic_problems, make_arithmetic_rows
from scalerl.demo import AGENT_DEMO_CONFIG, run_agent_demo, weak_teacher_rows
from tests.tiny import tiny_overrides


def test_weak_teacher_errs_at_the_configured_rate():
    rows = [{"prompt": f"Q:{i}+0\nA:", "response": f" #### {i}", "ground_truth": str(i)} for i in range(2000)]
    taught = weak_teacher_rows(rows, 0.6, seed=0)
    wrong = [r for r in taught if not r["response"].endswith(f"#### {r['ground_truth']}")]
    assert 0.55 < len(wrong) / len(rows) < 0.65
    assert all(r["response"].endswith(f"#### {int(r['ground_truth']) + 1}") for r in wrong)
    assert [r["ground_truth"] for r in taught] == [r["ground_truth"] for r in rows]


def test_demo_command_runs_sft_then_grpo(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", *tiny_overrides("actor.ppo_micro_batch_size=8"), f"trainer.output_dir={out}"])
    assert code == 0
    result = json.loads((out / "demo_result.json").read_text())
    assert 0 <= result["heldout_accuracy_sft"] <= 1 and 0 <= result["heldout_accuracy_grpo"] <= 1
    assert (out / "grpo" / "metrics.png").is_file() and (out / "sft" / "model" / "model.safetensors").is_file()
    assert "held-out accuracy after GRPO" in capsys.readouterr().out


def test_demo_teaches_on_most_of_the_distinct_training_problems():
    # The demo's SFT learns the sums only from most of the problems (with 4,000 of 9,840, seed 2's SFT model
    # erred at random on unseen ones and GRPO gained 4 points); more than there are would fail to load.
    cfg = load_config(DEMO_CONFIG)
    levels = sorted(set(cfg.data.difficulty))
    available = sum(count_arithmetic_problems("train", level) for level in levels)
    assert 0.9 * available <= cfg.data.num_train <= available
    rows = make_arithmetic_rows("train", cfg.data.num_train, list(cfg.data.difficulty), seed=2)
    assert len({r["prompt"] for r in rows}) == cfg.data.num_train


# ---- `scalerl demo --agent` (SFT on tool-use demonstrations, then GRPO with the tool environment) at toy size,
# and its baseline without the tool (the measured numbers are in docs/rollout.md)
TOY = tiny_overrides("data.num_train=32", "data.num_val=4", "actor.ppo_micro_batch_size=8", "trainer.total_steps=1",
                     "sft.steps=2", "rollout.max_new_tokens=8")


def test_demo_agent_runs_sft_then_grpo_with_the_tool(tmp_path, capsys):
    out = tmp_path / "agent"
    assert main(["demo", "--agent", *TOY, f"trainer.output_dir={out}"]) == 0
    result = json.loads((out / "demo_result.json").read_text())
    assert result["use_tool"] is True
    assert 0 <= result["heldout_accuracy_sft"] <= 1 and 0 <= result["heldout_accuracy_grpo"] <= 1
    demos = [json.loads(line) for line in (out / "data" / "teacher_demonstrations.jsonl").read_text().splitlines()]
    assert len(demos) == 2 * 32 and demos[0]["response"].startswith("<tool_call>")  # the call, then the answer
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("agent/turns/mean" in m for m in metrics)  # GRPO ran episodes with the tool environment
    assert (out / "grpo" / "final" / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "held-out accuracy after GRPO" in printed and "with the tool" in printed


def test_the_baseline_runs_the_same_pipeline_without_the_tool(tmp_path):
    cfg = load_config(AGENT_DEMO_CONFIG, [*TOY, f"trainer.output_dir={tmp_path / 'plain'}"])
    result = run_agent_demo(cfg, use_tool=False)
    assert result["use_tool"] is False and result["tool_call_rate_grpo"] == 0
    demos = (tmp_path / "plain" / "data" / "teacher_demonstrations.jsonl").read_text()
    assert "<tool_call>" not in demos and len(demos.splitlines()) == 32
    metrics = [json.loads(line) for line in (tmp_path / "plain" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert not any("agent/turns/mean" in m for m in metrics)  # single-turn GRPO
