"""benchmarks/distill_demo.py without training: run-directory names, the per-seed target, and the table built by
``--reuse`` from faked finished runs of different lengths."""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import pytest


def _run(points: list[tuple[int, float, float]]) -> dict:
    return {"curve": points, "median_step_s": 1.0}


def _write_metrics(path: Path, accuracies: dict[int, float], steps: int, step_s: float) -> None:
    """A run's metrics.jsonl as the trainer writes it: one row per step with its time, held-out accuracy at the
    evaluated steps (step 0: before the first)."""
    rows = [{"step": 0, "val/accuracy": accuracies[0]}]
    for step in range(1, steps + 1):
        rows.append({"step": step, "timing_s/step": step_s, **({"val/accuracy": accuracies[step]}
                                                             if step in accuracies else {})})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_run_directories_name_each_arms_steps_and_rate_and_keep_the_old_names(repo_script):
    bench = repo_script("benchmarks/distill_demo.py")

    def tags(steps, lr, eval_every=5):
        args = argparse.Namespace(steps=steps, lr=lr, eval_every=eval_every, top_k=16, task_weight=1.0, coef=1.0)
        return [bench.run_tag(args, arm) for arm in bench.ARMS]

    assert tags([40], [1e-4]) == ["_lr0.0001", "_lr0.0001_top16"]  # the runs made before --steps took two values
    assert tags([40], None) == ["", "_top16"]
    assert tags([150, 80], [1e-4]) == ["_lr0.0001_s150", "_lr0.0001_s80_top16"]
    assert tags([150, 80], [3e-5, 1e-4]) == ["_lr3e-05_s150", "_lr0.0001_s80_top16"]
    assert tags([40], [1e-4], eval_every=10) == ["_lr0.0001_e10", "_lr0.0001_e10_top16"]
    assert bench.per_arm([7]) == {"grpo": 7, "grpo+distill": 7}
    assert bench.per_arm([7, 9]) == {"grpo": 7, "grpo+distill": 9}


def test_target_gain_is_per_seed_from_its_start_and_fixed_and_default_targets_are_one(repo_script):
    bench = repo_script("benchmarks/distill_demo.py")
    runs = {"grpo": {0: _run([(0, 0.40, 0.0), (10, 0.38, 30.0)]), 1: _run([(0, 0.48, 0.0), (10, 0.50, 30.0)])}}
    assert bench.targets(runs, [0, 1], None, 0.05) == pytest.approx({0: 0.45, 1: 0.53})
    assert bench.targets(runs, [0, 1], 0.6, None) == {0: 0.6, 1: 0.6}
    assert bench.targets(runs, [0, 1], None, None) == {0: 0.38, 1: 0.38}  # GRPO alone's lowest final


def test_an_accuracy_logged_as_float32_reaches_a_target_of_the_same_value(repo_script):
    """43.6% logged as float32 (0.43599998...) reaches 38.6% + 5 points (0.43600000... in float64); 43.4% does not."""
    bench = repo_script("benchmarks/distill_demo.py")

    def float32(value):
        return struct.unpack("f", struct.pack("f", value))[0]

    target = float32(0.386) + 0.05
    assert float32(0.436) < target
    assert bench.reached([(0, float32(0.386), 0.0), (20, float32(0.436), 60.0)], target) == (20, 60.0)
    assert bench.reached([(0, float32(0.386), 0.0), (20, float32(0.434), 60.0)], target) is None


def test_an_arm_that_never_reaches_the_target_bounds_the_ratio(repo_script):
    bench = repo_script("benchmarks/distill_demo.py")
    slow = _run([(0, 0.40, 0.0), (10, 0.42, 30.0), (20, 0.46, 60.0)])
    fast = _run([(0, 0.40, 0.0), (5, 0.46, 25.0), (10, 0.50, 50.0)])
    never = _run([(0, 0.40, 0.0), (10, 0.41, 30.0), (150, 0.44, 450.0)])

    both = bench.compare(slow, fast, 0.45)
    assert (both["grpo"], both["distill"], both["bound"]) == ((20, 60.0), (5, 25.0), "=")
    assert both["steps_ratio"] == pytest.approx(4.0) and both["time_ratio"] == pytest.approx(2.4)
    assert "4.00x" in bench.format_row(0, both, (3.0, 5.0)) and ">" not in bench.format_row(0, both, (3.0, 5.0))

    grpo_never = bench.compare(never, fast, 0.45)  # GRPO alone would reach it after step 150, if ever
    assert grpo_never["grpo"] is None and grpo_never["bound"] == ">"
    assert grpo_never["steps_ratio"] == pytest.approx(30.0) and grpo_never["time_ratio"] == pytest.approx(18.0)
    line = bench.format_row(0, grpo_never, (3.0, 5.0))
    assert "never in 150 (450 s)" in line and ">30.00x" in line and ">18.00x" in line

    distill_never = bench.compare(slow, never, 0.45)
    assert distill_never["bound"] == "<" and distill_never["steps_ratio"] == pytest.approx(20 / 150)
    neither = bench.compare(never, never, 0.45)
    assert neither["bound"] is None and neither["steps_ratio"] is None
    assert bench.format_row(0, neither, (3.0, 5.0)).count("never in 150") == 2


def test_the_table_comes_from_reused_runs_of_different_lengths(tmp_path, monkeypatch, capsys, repo_script):
    """--reuse with --steps 150 80: no stage trains; the faked runs are read back and compared per seed."""
    bench = repo_script("benchmarks/distill_demo.py")
    out = tmp_path / "demo"
    for stage in ("teacher", "student"):  # models --reuse keeps (never loaded: the teacher's accuracy is cached)
        (out / stage / "sft" / "model").mkdir(parents=True)
        (out / stage / "sft" / "model" / "config.json").write_text("{}")
    teacher = out / "teacher" / "sft" / "model"
    (out / "teacher" / "held_out.json").write_text(json.dumps({"model_dir": str(teacher), "val/accuracy": 0.9}))
    # seed 0: the distilled arm reaches start + 5 points at step 10, GRPO alone at step 60; seed 1: GRPO alone never
    _write_metrics(out / "student" / "grpo_lr0.0001_s150_seed0" / "metrics.jsonl",
                   {0: 0.40, 30: 0.42, 60: 0.45, 150: 0.47}, 150, 2.0)
    _write_metrics(out / "student" / "grpo+distill_lr0.0001_s80_top16_seed0" / "metrics.jsonl",
                   {0: 0.40, 10: 0.46, 80: 0.50}, 80, 4.0)
    _write_metrics(out / "student" / "grpo_lr0.0001_s150_seed1" / "metrics.jsonl", {0: 0.48, 150: 0.50}, 150, 2.0)
    _write_metrics(out / "student" / "grpo+distill_lr0.0001_s80_top16_seed1" / "metrics.jsonl",
                   {0: 0.48, 20: 0.53, 80: 0.55}, 80, 4.0)
    monkeypatch.setattr(sys, "argv", ["distill_demo.py", "--out", str(out), "--reuse", "--seeds", "0", "1",
                                      "--teacher-steps", "0", "--lr", "1e-4", "--steps", "150", "80", "--top-k", "16",
                                      "--target-gain", "0.05"])
    bench.main()
    printed = capsys.readouterr().out
    assert "GRPO steps" not in printed  # nothing trained
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == {"grpo": 150, "grpo+distill": 80} and result["target_gain"] == 0.05
    seed0, seed1 = result["table"]
    assert seed0["target"] == pytest.approx(0.45) and seed1["target"] == pytest.approx(0.53)
    assert seed0["grpo"] == [60, 120.0] and seed0["distill"] == [10, 40.0] and seed0["bound"] == "="
    assert seed0["steps_ratio"] == pytest.approx(6.0) and seed0["time_ratio"] == pytest.approx(3.0)
    assert seed1["grpo"] is None and seed1["bound"] == ">" and seed1["steps_ratio"] == pytest.approx(7.5)
    assert "never in 150 (300 s)" in printed and ">7.50x" in printed


def test_target_and_target_gain_exclude_each_other_and_steps_take_at_most_two(monkeypatch, capsys, repo_script):
    bench = repo_script("benchmarks/distill_demo.py")
    for argv, message in ((["--target", "0.5", "--target-gain", "0.05"], "not allowed with argument --target"),
                          (["--steps", "1", "2", "3"], "--steps takes one value (both arms) or two")):
        monkeypatch.setattr(sys, "argv", ["distill_demo.py", *argv])
        with pytest.raises(SystemExit):
            bench.main()
        assert message in capsys.readouterr().err
