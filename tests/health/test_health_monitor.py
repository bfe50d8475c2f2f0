"""The online monitor: rules every N steps on reduced metrics, one message per crossing, health/* levels."""

import math

import torch

from scalerl.core.config import load_config
from scalerl.health import HealthMonitor
from scalerl.parallel.mesh import ParallelDims

HEALTHY = {"timing_s/step": 1.0, "timing_s/data": 0.01, "actor/pg_loss": 0.1, "critic/score/mean": 0.5,
           "critic/score/max": 1.0, "critic/score/min": 0.0, "perf/max_memory_gb": 1.0}


def monitor(every=2):
    messages = []
    context = {"device": "cpu", "world_size": 1, "dp_size": 1, "tp": 1, "pp": 1, "memory_capacity_gb": 64.0}
    return HealthMonitor(every, context, messages.append), messages


def test_checks_every_n_steps_and_reports_levels():
    m, messages = monitor(every=2)
    assert m.observe(1, HEALTHY) == {}
    levels = m.observe(2, HEALTHY)
    assert levels["health/training/non_finite"] == 0.0 and levels["health/resources/storage_io"] == 0.0
    assert "health/training/reward_collapse" not in levels  # 2 steps of rewards: not measured yet
    assert messages == []


def test_one_message_per_crossing_and_again_after_it_clears():
    m, messages = monitor(every=1)
    slow_data = dict(HEALTHY, **{"timing_s/data": 0.6})
    m.observe(1, slow_data)
    m.observe(2, slow_data)
    assert len(messages) == 1 and "storage I/O: fault" in messages[0] and "fix: read data.train_files" in messages[0]
    m.observe(3, HEALTHY)
    m.observe(4, dict(HEALTHY, **{"timing_s/data": 0.2}))  # crosses again, now as a warning
    assert len(messages) == 2 and "storage I/O: warning" in messages[1]
    m.observe(5, dict(HEALTHY, **{"timing_s/data": 0.6}))  # warning -> fault is a new crossing
    assert len(messages) == 3 and "fault" in messages[2]


def test_non_finite_loss_is_reported_at_once():
    m, messages = monitor(every=1)
    levels = m.observe(1, dict(HEALTHY, **{"actor/pg_loss": math.nan}))
    assert levels["health/training/non_finite"] == 2.0
    assert "non-finite values: actor/pg_loss" in messages[0]


def test_reward_history_is_kept_between_checks():
    m, messages = monitor(every=5)
    flat = dict(HEALTHY, **{"critic/score/mean": 0.0, "critic/score/max": 0.0, "critic/score/min": 0.0})
    for step in range(1, 6):
        levels = m.observe(step, flat)
    assert levels["health/training/reward_collapse"] == 1.0 and "GRPO advantages are all 0" in messages[-1]


def test_a_growing_train_inference_gap_is_reported_as_it_grows():
    """A drifting engine: the step metrics' rollout/logprob_diff/mean grows 30% a step; the monitor, checking
    every 3 steps, says nothing while it is small and steady, then warns once it has doubled."""
    m, messages = monitor(every=3)
    levels = {}
    for step in range(1, 4):
        levels = m.observe(step, dict(HEALTHY, **{"rollout/logprob_diff/mean": 0.005}))
    assert levels["health/training/logprob_mismatch"] == 0.0 and messages == []
    for step in range(4, 10):
        levels = m.observe(step, dict(HEALTHY, **{"rollout/logprob_diff/mean": 0.005 * 1.3 ** (step - 3)}))
    assert levels["health/training/logprob_mismatch"] >= 1.0
    (message,) = [msg for msg in messages if "train/inference mismatch" in msg]
    assert "x its first steps'" in message and "rollout.is_cap" in message


def test_off_when_every_is_zero_and_built_from_a_config():
    cfg = load_config(None, ["trainer.monitor_every=0"])
    m = HealthMonitor.for_run(cfg.trainer.monitor_every, cfg, ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1),
                              torch.device("cpu"), log=False)
    assert m.observe(10, dict(HEALTHY, **{"actor/pg_loss": math.nan})) == {}
    assert m.context["memory_capacity_gb"] > 0 and m.context["balance_batch"] is True
