"""Rules on step metrics: the same checks run by the online monitor (on the metrics every step already
reduces over ranks) and by `scalerl doctor --performance-profiling` (which adds per-rank measurements).

Each rule reads a `StepView` and returns findings for its leaf, "not measured" (with why) when its inputs
are absent. Thresholds, reasons and fixes come from `scalerl.health.thresholds`; the rules live by
branch in `compute_rules`, `comm_rules`, `resource_rules` and `training_rules`.
"""

from __future__ import annotations

from collections.abc import Callable

from scalerl.health.comm_rules import achieved_bandwidth, comm_share
from scalerl.health.compute_rules import (
    parallel_granularity,
    stragglers,
    token_imbalance,
)
from scalerl.health.resource_rules import (
    checkpoint_interval,
    data_wait,
    host_device_share,
    memory_peak,
)
from scalerl.health.training_rules import non_finite, reward_collapse
from scalerl.health.tree import Finding
from scalerl.health.view import StepView

__all__ = ["STEP_RULES", "StepView", "reward_collapse", "run_step_rules"]

STEP_RULES: tuple[Callable[[StepView], list[Finding]], ...] = (
    stragglers, token_imbalance, parallel_granularity, comm_share, achieved_bandwidth, memory_peak,
    host_device_share, data_wait, checkpoint_interval, non_finite,
)


def run_step_rules(view: StepView, reward_history: list[dict[str, float]] | None = None) -> list[Finding]:
    """Every step rule's findings for ``view`` (and the reward history, when given)."""
    findings = [f for rule in STEP_RULES for f in rule(view)]
    if reward_history is not None:
        findings += reward_collapse(reward_history)
    return findings
