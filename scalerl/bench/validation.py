"""The cost model against the cells it can be checked on: every measured cell with more than one rank is
projected from the calibration cell's compute rates, the probed links and the cell's own layout and batch,
and the projection's step time, communication time and bytes are compared with what the cell measured.

Communication is compared over the kinds whose waits are measured (`scalerl.comm.counting.accounting.TIMED_KINDS`:
not TP's collectives nor pipeline sends, which are counted in bytes only). ``contention`` is this host's:
the cell's trainer ranks per core left free by other processes while it ran (their load measured from the
kernel's counters), 1 on a real cluster. ``compute`` compares the projected compute (plus untimed TP and
pipeline traffic) with the measured step minus its measured waits: on a shared machine most of the step
time's error is there, in other processes' load, rather than in the communication model.
"""

from __future__ import annotations

from typing import Any

from scalerl.bench.calibration import (
    cell_layout,
    cell_model,
    cell_step,
    compute_rates,
    links_for,
)
from scalerl.bench.cost_model.step_projection import project_step

TARGET_ERROR = 0.15
# Kinds whose waits are measured, less ``rollout``: a trainer's wait for standalone workers' outputs is
# mostly their generation time, which the model counts as compute.
TIMED_KINDS = ("grad", "param", "rebalance", "weight_sync", "metrics")


def _error(projected: float, measured: float) -> float | None:
    return (projected - measured) / measured if measured > 0 else None


def validate_cells(report: dict[str, Any]) -> list[dict[str, Any]]:
    cells = [c for c in report["cells"] if c.get("status") == "ok"]
    calibration = next((c for c in cells if c.get("calibration")), None)
    if calibration is None:
        return []
    rates = compute_rates(calibration)
    out = []
    for cell in cells:
        if cell["world"] + cell.get("workers", 0) <= 1:
            continue
        model, (step, lengths), layout = cell_model(cell), cell_step(cell), cell_layout(cell)
        links = links_for(report, cell)
        contention = cell.get("cpu", {}).get("contention", 1.0)
        estimate = project_step(model, step, layout, lengths, rates, links, contention)
        measured_step = cell["latency_ms"]["step"]["median"] / 1e3
        measured_comm = sum(cell.get("comm_s", {}).get(k, 0.0) for k in TIMED_KINDS)
        measured_compute = max(0.0, measured_step - measured_comm)
        projected_comm = sum(v for k, v in estimate.comm_s.items() if k in TIMED_KINDS)
        untimed = sum(v for k, v in estimate.comm_s.items() if k not in TIMED_KINDS)
        measured_bytes = cell["bytes_per_step"].get("total", 0.0)
        projected_bytes = sum(estimate.bytes_per_rank.values())
        entry = {
            "cell": cell["id"], "strategy": cell["strategy"], "nodes": cell["nodes"], "world": cell["world"],
            "rate_mbit": cell["rate_mbit"], "contention": contention,
            "measured": {"step_s": measured_step, "comm_s": measured_comm, "bytes_per_step": measured_bytes,
                         "compute_s": measured_compute},
            "projected": {"step_s": estimate.step_s, "compute_s": estimate.compute_total_s,
                          "comm_s": projected_comm, "comm_untimed_s": untimed, "bytes_per_step": projected_bytes,
                          "comm_by_kind_s": estimate.comm_s, "bytes_by_kind": estimate.bytes_per_rank},
            "links": {"inter": links.inter.source, "intra": links.intra.source},
            "error": {"step": _error(estimate.step_s, measured_step), "bytes": _error(projected_bytes, measured_bytes),
                      "compute": _error(estimate.compute_total_s + untimed, measured_compute),
                      "comm": _error(projected_comm, measured_comm) if measured_comm > 0.005 else None},
        }
        if entry["error"]["comm"] is None:
            entry["comm_note"] = ("communication time not compared: under 5 ms measured" if untimed == 0 else
                                  "communication is mostly TP/pipeline traffic, whose waits are not measured")
        errors = [abs(e) for e in (entry["error"]["step"], entry["error"]["comm"]) if e is not None]
        entry["within_target"] = bool(errors) and max(errors) <= TARGET_ERROR
        out.append(entry)
    return out


def validation_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst absolute errors over the validated cells."""
    def spread(key: str) -> dict[str, float] | None:
        values = sorted(abs(e["error"][key]) for e in entries if e["error"].get(key) is not None)
        if not values:
            return None
        return {"median": values[len(values) // 2], "max": values[-1], "cells": len(values)}

    return {"target": TARGET_ERROR, "step": spread("step"), "comm": spread("comm"), "bytes": spread("bytes"),
            "compute": spread("compute"),
            "within_target": sum(e["within_target"] for e in entries), "cells": len(entries)}
