"""The demo pipeline end to end at toy size (the real demo's numbers are measured in the README)."""

import json

from scalerl.cli import DEMO_CONFIG, main
from scalerl.core.config import load_config
from scalerl.data.arithmetic import count_arithmetic_problems, make_arithmetic_rows
from scalerl.demo import weak_teacher_rows
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
