"""`--compare` verdicts against the noise band, and the report schema's checks (synthetic reports)."""

from __future__ import annotations

import copy
import json

import pytest

from scalerl.bench.compare import compare_reports, format_comparison
from scalerl.bench.schema import (
    SCHEMA,
    ReportError,
    load_report,
    new_report,
    problems,
    write_report,
)
from scalerl.bench.summary import scaling_efficiency, stats


def _cell(cell_id: str, tokens_per_s: float, step_ms: float, spread: float = 0.02, nodes: int = 1,
          devices: int = 1, calibration: bool = False) -> dict:
    tps = {**stats([tokens_per_s] * 3), "rel_iqr": spread}
    step = {**stats([step_ms] * 3), "rel_iqr": spread}
    strategy = cell_id.split("|")[0]
    return {"id": cell_id, "strategy": strategy, "nodes": nodes, "ranks_per_node": 1, "world": devices,
            "devices": devices, "workers": 0, "rate_mbit": 0.0 if nodes == 1 else 200.0, "compression": "none",
            "allreduce": "default", "weight_sync": "colocated", "calibration": calibration, "status": "ok",
            "throughput": {"tokens_per_s": tps}, "latency_ms": {"step": step, "gen": dict(step)},
            "bytes_per_step": {"total": 0.0}, "bytes_per_s": {"total": 0.0}, "cpu": {}, "memory": {"peak_gb": 0.4},
            "work": {}}


def _report(cells: list[dict]) -> dict:
    report = new_report("test", {"steps": 3})
    report["cells"] = cells
    return report


def test_compare_separates_noise_from_change():
    a = _report([_cell("ddp|2x1", 1000, 100), _cell("fsdp|2x1", 500, 200, spread=0.10)])
    b = copy.deepcopy(a)
    b["cells"][0]["throughput"]["tokens_per_s"]["median"] = 800  # 20% fewer tokens/s: beyond a 3% band
    b["cells"][0]["latency_ms"]["step"]["median"] = 125
    b["cells"][1]["throughput"]["tokens_per_s"]["median"] = 550  # +10% inside a noisy cell's 14% band
    rows = {(r["cell"], r["metric"]): r for r in compare_reports(a, b)}
    assert rows[("ddp|2x1", "tokens/s")]["verdict"] == "WORSE"
    assert rows[("ddp|2x1", "ms/step")]["verdict"] == "WORSE"
    assert rows[("fsdp|2x1", "tokens/s")]["verdict"] == "within noise"
    assert rows[("fsdp|2x1", "tokens/s")]["band"] == pytest.approx((0.1 ** 2 * 2) ** 0.5)
    faster = copy.deepcopy(a)
    faster["cells"][0]["latency_ms"]["step"]["median"] = 80
    assert {(r["metric"], r["verdict"]) for r in compare_reports(a, faster) if r["cell"] == "ddp|2x1"} >= \
        {("ms/step", "better")}
    text = format_comparison(compare_reports(a, b), "a.json", "b.json", a, b)
    assert "WORSE" in text and "2 metric(s) worse beyond the noise band" in text
    assert compare_reports(a, _report([_cell("tp|2x1", 1, 1)])) == []


def test_scaling_efficiency_against_the_one_node_cell():
    cells = [_cell("single|1x1", 1000, 50, calibration=True), _cell("ddp|2x1", 1500, 60, nodes=2, devices=2),
             _cell("ddp|4x1", 2000, 80, nodes=4, devices=4)]
    scaling_efficiency(cells)
    assert cells[1]["scaling_efficiency"] == pytest.approx(0.75)
    assert cells[2]["scaling_efficiency"] == pytest.approx(0.5)
    assert cells[2]["scaling_reference"] == "single|1x1"


def test_schema_problems_and_loading(tmp_path):
    good = _report([_cell("ddp|2x1", 1000, 100)])
    assert good["schema"] == SCHEMA and problems(good) == []
    assert {"git_commit", "torch", "cpu_model", "cores", "load_average_before"} <= set(good["environment"])
    bad = copy.deepcopy(good)
    del bad["cells"][0]["throughput"]
    bad["cells"].append({**_cell("fsdp|2x1", 1, 1), "status": "failed"})
    found = problems(bad)
    assert any("has no 'throughput'" in p for p in found) and any("failed without a reason" in p for p in found)
    assert problems({"schema": "scalerl.doctor/1"}) == ["schema is 'scalerl.doctor/1', expected 'scalerl.bench/1'"]
    path = write_report(good, tmp_path / "r.json")
    assert load_report(path)["cells"][0]["id"] == "ddp|2x1"
    (tmp_path / "doctor.json").write_text(json.dumps({"schema": "scalerl.doctor/1"}))
    with pytest.raises(ReportError, match="doctor.json: not a scalerl.bench/1 report"):
        load_report(tmp_path / "doctor.json")
    with pytest.raises(ReportError, match="no such file"):
        load_report(tmp_path / "missing.json")
