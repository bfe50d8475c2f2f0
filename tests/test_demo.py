"""The demo pipeline end to end at toy size (the real demo's numbers are measured in the README)."""

import json

from scalerl.cli import main
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
