"""`--plan PLAN.json`: a recorded `scalerl plan --json` of the tiny config against recorded profile records:
each plan phase beside the profiler's phases that make it up, errors signed (planned / measured - 1), the
table printed; a missing or foreign file is refused by name before any profile runs."""

from __future__ import annotations

import io
import json

import pytest

from scalerl.core.config import ConfigError
from scalerl.doctor.plan_comparison import compare_plan, read_plan
from scalerl.doctor.render import _plan_table
from tests.health.recorded_measurements import rank_profile

# `scalerl plan <tiny config> --no-recommend --json` on this machine (2 CPU cores, busy), the keys read here.
PLAN = {"schema": "scalerl.plan/1",
        "seconds": {"generation": 2.569, "old_log_prob": 0.0, "ref_log_prob": 0.0, "update": 5.722,
                    "weight_sync": 0.0, "other": 0.0, "checkpoint_save": 0.00228, "evaluation": 1.280},
        "memory_gb": {"generation": {"total": 0.3343}, "update": {"total": 0.3333},
                      "checkpoint_save": {"total": 0.3309}, "evaluation": {"total": 0.3326}},
        "step_seconds": 8.291, "peak_memory_gb": 0.3343,
        "cluster": {"nodes": 1, "devices_per_node": 1, "device": "cpu"},
        "calibration": {"source": "this machine's CPU (2 cores)"}}


def records() -> list[dict]:
    out = []
    for rank in range(2):
        r = rank_profile(rank)
        r["phases"]["optimizer"] = {"time_s": 0.1, "busy_s": 0.1, "wait_s": 0.0, "peer_s": 0.0, "comm_s": 0.0,
                                    "peak_gb": 4.5}
        r["phases"]["update_weights"] = {"time_s": 0.0002, "busy_s": 0.0002, "wait_s": 0.0, "peer_s": 0.0,
                                         "comm_s": 0.0, "peak_gb": 4.0}
        r["save_s"] = 0.5 + rank * 0.5
        out.append(r)
    return out


def test_each_plan_phase_against_the_profilers_phases_that_make_it_up():
    rows = {r["phase"]: r for r in compare_plan(PLAN, records(), "plan.json")["rows"]}
    gen, update = rows["generation"], rows["update"]
    assert gen["measured_s"] == pytest.approx(0.6) and gen["time_error"] == pytest.approx(2.569 / 0.6 - 1)
    # update = update_actor (0.6) + the optimizer nested in it (0.1, timed apart); memory: the larger peak
    assert update["measured_s"] == pytest.approx(0.7) and update["measured_gb"] == 4.5
    assert update["memory_error"] == pytest.approx(0.3333 / 4.5 - 1)
    assert rows["checkpoint_save"]["measured_s"] == pytest.approx(0.75)  # the mean of the ranks' saves
    # 0.2 ms of weight sync is timer noise: no relative error; phases the profile has not: no numbers
    assert rows["weight_sync"]["measured_s"] == pytest.approx(0.0002) and rows["weight_sync"]["time_error"] is None
    assert rows["evaluation"]["measured_s"] is None and rows["ref_log_prob"]["measured_s"] is None
    assert rows["step"]["measured_s"] == pytest.approx(1.3) and rows["step"]["measured_gb"] == 4.5


def test_the_table_prints_every_row_with_signed_errors():
    from rich.console import Console

    table = _plan_table({"plan": compare_plan(PLAN, records(), "plan.json")})
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    text = out.getvalue()
    assert "planned vs measured per phase (plan.json" in table.title
    assert "generation" in text and "+328%" in text and "-93%" in text  # 2.569 / 0.6; 0.3333 / 4.5
    assert _plan_table({}) is None


def test_a_missing_or_foreign_plan_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"--plan .*nope.json: no such file; write one with `scalerl plan"):
        read_plan(tmp_path / "nope.json")
    report = tmp_path / "doctor.json"
    report.write_text(json.dumps({"schema": "scalerl.doctor/1"}))
    with pytest.raises(ConfigError, match="not a scalerl.plan/1 document"):
        read_plan(report)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "scalerl.plan/1", "seconds": {}}))
    with pytest.raises(ConfigError, match="missing memory_gb, step_seconds"):
        read_plan(old)
    good = tmp_path / "plan.json"
    good.write_text(json.dumps(PLAN))
    assert read_plan(good)["step_seconds"] == 8.291


def test_the_cli_refuses_a_plan_without_a_profile():
    import argparse

    from scalerl.doctor.cli import add_doctor_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_doctor_arguments(parser)
    with pytest.raises(ConfigError, match="add --performance-profiling CONFIG"):
        options_from_args(parser.parse_args(["--plan", "plan.json"]))


def test_the_steps_planned_peak_is_over_the_profiled_phases_not_evaluation():
    # evaluation (0.3326) and checkpoint save run outside the profiled steps: the step's planned peak is the
    # largest of generation (0.3343) and update (0.3333), even when evaluation's plan is the largest
    plan = {**PLAN, "memory_gb": {**PLAN["memory_gb"], "evaluation": {"total": 9.0}}, "peak_memory_gb": 9.0}
    step = next(r for r in compare_plan(plan, records(), "plan.json")["rows"] if r["phase"] == "step")
    assert step["planned_gb"] == pytest.approx(0.3343)
    assert step["memory_error"] == pytest.approx(0.3343 / 4.5 - 1)
