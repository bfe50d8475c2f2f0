"""How a run that cannot go on ends: repeated skipped optimizer steps stop it naming the last checkpoint
from before the skipping began (the collective failures are in tests/parallel/test_collective_failures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scalerl.core.errors import RunFailure
from scalerl.trainer.rl_trainer import train
from scalerl.trainer.run_failures import SkippedStepGuard, last_good_checkpoint
from scalerl.trainer.update import OptimizerStep


def _checkpoint(root, step):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"format_version": 1, "step": step, "files": {}}))
    return path


def test_consecutive_skips_run_over_updates_and_reset_on_a_good_step():
    step = OptimizerStep(optimizer=None, grad_scaler=None, max_norm=1.0)
    step.count_skips([0.0, 1.0, 1.0])
    step.count_skips([1.0])
    assert step.consecutive_skips == 3
    step.count_skips([1.0, 0.0])
    assert step.consecutive_skips == 0


def test_guard_names_the_checkpoint_from_before_the_streak(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        _checkpoint(root, s)
    guard = SkippedStepGuard(limit=3, prefix="actor", checkpoint_root=root)
    guard.after_step(4, 0)
    guard.after_step(5, 1)  # the streak begins in step 5: step 6's checkpoint was saved during it
    guard.after_step(6, 2)
    with pytest.raises(RunFailure) as stopped:
        guard.after_step(7, 3)
    message = str(stopped.value)
    assert "steps 5-7" in message and "trainer.max_skipped_steps=3" in message and "actor/skipped_steps" in message
    assert f"Last good checkpoint: {root / 'step_00000004'}" in message
    assert f"trainer.resume={root / 'step_00000004'}" in message
    assert "none from before step 1" in last_good_checkpoint(root, before_step=1)
    SkippedStepGuard(limit=0, prefix="actor", checkpoint_root=root).after_step(9, 100)  # 0: never stops


def test_a_diverged_run_stops_instead_of_skipping_forever(tiny_config, length_reward):
    # lr=1e30 turns the weights non-finite after the first update; every later gradient is NaN.
    cfg = tiny_config(length_reward, "actor.lr=1e30", "trainer.total_steps=8", "trainer.max_skipped_steps=3",
                      "trainer.save_every=1", "rollout.max_new_tokens=8")
    with pytest.raises(RunFailure, match=r"optimizer steps in a row .* were skipped") as stopped:
        train(cfg)
    assert "Last good checkpoint: none from before step 1" in str(stopped.value)
    metrics = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(logged) < 8 and logged[-1]["actor/skipped_steps"] >= 1  # stopped early, after logging the step
