"""`scalerl doctor --performance-profiling CONFIG --plan PLAN.json`: the plan `scalerl plan ... --json PLAN.json`
wrote, beside what the profile measured, per phase: seconds per step and peak memory per rank.

The plan's phases are the profiler's under other names (generation = ``gen`` + ``gen_max``, update = the
actor's and critic's forward + backward + ``optimizer``, weight sync = ``update_weights``); a checkpoint save is
the run's own `save`, timed once after the steps. Measured seconds are the mean over ranks (the plan predicts
one rank, every rank alike), memory the largest peak of any rank. Torch-free: the CLI reads the plan before
any rank starts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from scalerl.core.config import ConfigError

PLAN_SCHEMA = "scalerl.plan/1"
# Plan phase -> the profiler's phases that make it up (`scalerl.plan.memory.PHASES` against the trainer's timers).
MEASURED_AS = {
    "generation": ("gen", "gen_max"),
    "old_log_prob": ("old_log_prob",),
    "ref_log_prob": ("ref",),
    "update": ("update_actor", "update_critic", "optimizer"),
    "weight_sync": ("update_weights",),
}


def read_plan(path: str | Path) -> dict[str, Any]:
    """The JSON `scalerl plan --json` wrote, checked for what the comparison reads."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--plan {path}: no such file; write one with `scalerl plan CONFIG --json {path}`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--plan {path}: not readable JSON ({e}); write it with `scalerl plan CONFIG --json "
                          f"{path}`") from None
    if not isinstance(plan, dict) or plan.get("schema") != PLAN_SCHEMA:
        schema = plan.get("schema") if isinstance(plan, dict) else None
        raise ConfigError(f"--plan {path}: not a {PLAN_SCHEMA} document (schema {schema!r}); write it with "
                          f"`scalerl plan CONFIG --json {path}`")
    missing = [k for k in ("seconds", "memory_gb", "step_seconds") if k not in plan]
    if missing:
        raise ConfigError(f"--plan {path}: missing {', '.join(missing)}; rewrite it with this scalerl's `scalerl "
                          "plan --json`")
    return plan


# Below a millisecond a measured phase is timer noise: no relative error is said against it.
MIN_MEASURED_S = 1e-3


def _error(planned: float | None, measured: float | None, floor: float = 0.0) -> float | None:
    if planned is None or measured is None or measured <= floor:
        return None
    return planned / measured - 1.0


def compare_plan(plan: dict[str, Any], records: list[dict[str, Any]], source: str = "") -> dict[str, Any]:
    """Rows of planned vs measured per plan phase (and the whole step): ``planned_s``, ``measured_s``,
    ``time_error`` (planned / measured - 1), ``planned_gb``, ``measured_gb``, ``memory_error``; None where
    one side has no number."""
    rows = []
    for phase, planned_s in plan["seconds"].items():
        planned_gb = (plan["memory_gb"].get(phase) or {}).get("total")
        measured_s = measured_gb = None
        if phase in MEASURED_AS:
            names = MEASURED_AS[phase]
            present = [r for r in records if any(n in r["phases"] for n in names)]
            if present:
                measured_s = statistics.mean(sum(r["phases"][n]["time_s"] for n in names if n in r["phases"])
                                             for r in present)
                measured_gb = max(r["phases"][n]["peak_gb"] for r in present for n in names if n in r["phases"])
        elif phase == "checkpoint_save" and any("save_s" in r for r in records):
            measured_s = statistics.mean(r["save_s"] for r in records if "save_s" in r)
        rows.append({"phase": phase, "planned_s": planned_s, "measured_s": measured_s,
                     "time_error": _error(planned_s, measured_s, MIN_MEASURED_S), "planned_gb": planned_gb,
                     "measured_gb": measured_gb, "memory_error": _error(planned_gb, measured_gb)})
    step = statistics.mean(r["step_s"] for r in records) if records else None
    peak = max((p["peak_gb"] for r in records for p in r["phases"].values()), default=None)
    # The profiled steps' peak against the plan's peak over the same phases: checkpoint save and evaluation
    # run outside the profiled steps, so their planned peaks are not the step's.
    step_peaks = [(plan["memory_gb"].get(phase) or {}).get("total") for phase in MEASURED_AS]
    planned_peak = max((p for p in step_peaks if p is not None), default=plan.get("peak_memory_gb"))
    rows.append({"phase": "step", "planned_s": plan["step_seconds"], "measured_s": step,
                 "time_error": _error(plan["step_seconds"], step, MIN_MEASURED_S),
                 "planned_gb": planned_peak, "measured_gb": peak, "memory_error": _error(planned_peak, peak)})
    return {"source": source, "cluster": plan.get("cluster"), "calibration": (plan.get("calibration") or {}).get(
        "source"), "rows": rows}
