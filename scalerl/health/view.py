"""What the step rules read: one step's metrics reduced over ranks, and per-rank records when profiled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROFILE_HINT = "scalerl doctor --performance-profiling CONFIG measures it"


@dataclass
class StepView:
    """What the step rules read.

    ``metrics``: one step's metrics reduced over ranks (the trainer's names; spreads as ``<name>/max``...).
    ``per_rank``: when profiled, one dict per rank: ``rank``, ``host``, ``step_s``, ``busy_s`` (own work) and
    ``busy_by_step``, ``wait_s`` (blocked on peers and in collectives), ``comm_s`` (in collectives after peers arrived),
    ``update_tokens``, ``copy_s``, ``phases`` ({phase: {time_s, busy_s, wait_s, peak_gb}}), ``capacity_gb``.
    ``context``: facts from the config and the machine (see each rule).
    ``history``: the reduced metrics of the last steps, oldest first (the online monitor's memory), so a
    rule can ask whether something holds step after step.
    """

    metrics: dict[str, float]
    per_rank: list[dict[str, Any]] | None = None
    context: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return int(self.context.get("world_size", len(self.per_rank) if self.per_rank else 1))
