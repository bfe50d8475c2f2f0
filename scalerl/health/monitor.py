"""Online monitoring: every ``trainer.monitor_every`` steps the doctor's step rules run on the metrics the
step already reduced over ranks; a warning is logged once per crossing (when a finding turns warning or
fault, not again while it stays so), and each leaf's level goes to the metrics backends as ``health/*``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from scalerl.health.step_rules import MISMATCH_KEY, TRAJECTORY_KEYS, StepView, run_step_rules
from scalerl.health.tree import FAULT, LEAVES, WARNING, Finding, health_metrics
from scalerl.perf.memory import memory_capacity_gb

logger = logging.getLogger("scalerl.health")
REWARD_KEYS = ("critic/score/mean", "critic/score/max", "critic/score/min")
HISTORY_STEPS = 200  # reward history kept for the collapse rule (its windows are a few steps)
RECENT_STEPS = 10  # steps whose slowest rank the straggler rule compares (a straggler is slow step after step)
RECENT_KEYS = ("timing_s/busy/slowest_rank", "timing_s/busy/max", "timing_s/busy", "moe/expert_load_imbalance")


def _rollout_context(rollout: Any) -> dict[str, Any]:
    """What the rollout pipeline's rules read (`scalerl.health.rollout_rules`); an SFT run has none."""
    if rollout is None:
        return {}
    return {"rollout_placement": rollout.placement, "rollout_staleness": rollout.staleness,
            "rollout_workers": rollout.workers, "rollout_stream_groups": bool(getattr(rollout, "stream_groups", False)),
            # the log-prob mismatch rule's fix names the correction in force and the engine's precision
            "rollout_is_cap": getattr(rollout, "correction_cap", None), "rollout_is_level": getattr(rollout, "is_level", None),
            "rollout_dtype": getattr(rollout, "dtype", None)}


def _stream_context(cfg: Any) -> dict[str, Any]:
    """With rollout.stream_groups, what decides whether a worker's part has passes to run early: the rows a
    worker answers for against the micro-batch (only micro-batches inside one part run before the last)."""
    rollout, actor, trainer = (getattr(cfg, k, None) for k in ("rollout", "actor", "trainer"))
    if rollout is None or actor is None or not getattr(rollout, "stream_groups", False):
        return {}
    rows = trainer.batch_size * rollout.n // max(rollout.workers, 1)
    return {"stream_rows_per_worker": rows, "micro_batch": actor.ppo_micro_batch_size}


class HealthMonitor:
    """``observe(step, metrics)`` after each step; returns ``health/*`` metrics on checked steps."""

    def __init__(self, every: int, context: dict[str, Any], emit: Callable[[str], None] | None = None):
        self.every = every
        self.context = context
        self.emit = emit if emit is not None else logger.warning
        self.reward_history: list[dict[str, float]] = []
        self.mismatch_history: list[dict[str, float]] = []  # rollout/logprob_diff/mean per step, where measured
        self.recent: list[dict[str, float]] = []
        self._alerting: dict[tuple, str] = {}  # finding key -> status last reported

    @classmethod
    def for_run(cls, every: int, cfg: Any, dims: Any, device: torch.device, log: bool) -> HealthMonitor:
        """A monitor for a trainer: ``cfg`` the run's config, ``dims`` its parallel sizes (tp, pp, dp,
        world_size), ``log`` whether this process logs (rank 0)."""
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        context = {
            "device": device.type, "world_size": dims.world_size, "dp_size": dims.dp, "tp": dims.tp, "pp": dims.pp,
            "microbatches": cfg.parallel.microbatches, "pp_schedule": cfg.parallel.pp_schedule,
            "balance_batch": cfg.trainer.balance_batch, "memory_capacity_gb": memory_capacity_gb(device),
            # A CPU's memory is shared by the node's ranks; a GPU's is its rank's own.
            "ranks_sharing_memory": local_ranks if device.type == "cpu" else 1,
            "ep": getattr(dims, "ep", 1),
            "moe_capacity_factor": getattr(getattr(cfg, "model", None), "moe_capacity_factor", None),
            **_rollout_context(getattr(cfg, "rollout", None)), **_stream_context(cfg),
        }
        return cls(every, context, None if log else (lambda message: None))

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        if self.every <= 0:
            return {}
        if all(k in metrics for k in REWARD_KEYS):  # with the trajectory that names a collapse's cause
            kept = {k: metrics[k] for k in REWARD_KEYS + TRAJECTORY_KEYS if k in metrics}
            self.reward_history = (self.reward_history + [kept])[-HISTORY_STEPS:]
        if MISMATCH_KEY in metrics:
            self.mismatch_history = (self.mismatch_history + [{MISMATCH_KEY: metrics[MISMATCH_KEY]}])[-HISTORY_STEPS:]
        self.recent = (self.recent + [{k: metrics[k] for k in RECENT_KEYS if k in metrics}])[-RECENT_STEPS:]
        if step % self.every:
            return {}
        findings = run_step_rules(StepView(dict(metrics), None, self.context, self.recent), self.reward_history,
                                  self.mismatch_history)
        self._report_crossings(step, findings)
        return health_metrics(findings)

    def _report_crossings(self, step: int, findings: list[Finding]) -> None:
        now = {f.key: f for f in findings if f.status in (WARNING, FAULT)}
        for key, finding in now.items():
            if self._alerting.get(key) != finding.status:  # newly crossed, or warning -> fault
                self.emit(f"step {step}: {LEAVES[finding.leaf].title}: {finding.status}: {finding.summary}"
                          + (f"; fix: {finding.fix}" if finding.fix else ""))
        self._alerting = {key: f.status for key, f in now.items()}  # cleared ones may cross again later
