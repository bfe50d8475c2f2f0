"""A tiny matrix measured for real on this machine (one node: the calibration cell and DDP over 2 ranks on
loopback, 2 measured steps each), then everything that reads its report: schema, baselines, the compute
probe, validation, projection, compare; and the refusal to emulate nodes without root."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stdout

import pytest

from scalerl.bench.compare import compare_reports
from scalerl.bench.matrix import BenchMatrix
from scalerl.bench.projection import ProjectionTarget, project
from scalerl.bench.run import BenchError, run_bench
from scalerl.bench.schema import load_report, problems
from scalerl.bench.tables import measured_tables, projected_tables
from scalerl.cli import main


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "benchmark_report.json"
    matrix = BenchMatrix(strategies=["ddp", "tp4"], nodes=[1], ranks_per_node=2, steps=2, warmup=1,
                         overrides=["rollout.max_new_tokens=8"])
    stream = io.StringIO()
    run_bench(matrix, path, command="test", progress_stream=stream)
    return path, stream.getvalue()


def test_report_is_valid_and_complete(measured):
    path, progress = measured
    report = load_report(path)
    assert problems(report) == []
    cells = {c["id"]: c for c in report["cells"]}
    calibration = cells["single|1x1|0M|none|default|colocated"]
    ddp = cells["ddp|1x2|0M|none|default|colocated"]
    assert calibration["status"] == ddp["status"] == "ok", (calibration.get("reason"), ddp.get("reason"))
    assert "multiple of 4" in cells["tp4|1x2|0M|none|default|colocated"]["reason"]  # skipped, with the reason
    assert ddp["measured_steps"] == 2 and ddp["world"] == 2 and ddp["dp"] == 2
    assert ddp["bytes_per_step"]["grad"] > 0 and ddp["latency_ms"]["step"]["median"] > 0
    assert 0 < ddp["cpu"]["utilization_per_rank"] <= 1.5 and ddp["memory"]["peak_gb"] > 0
    assert ddp["work"]["rows"] == 2 * 4 * 4 and ddp["work"]["decode_steps"] <= 8
    assert ddp["throughput"]["tokens_per_s"]["median"] > 0 and ddp["scaling_efficiency"] == 1.0  # its own reference
    assert set(calibration["compute_probe"]) == {"train", "forward", "gen", "matmul_peaks", "fused_decode"}
    assert "link probe: loopback" in progress and "cell ddp|1x2" in progress
    assert report["links"]["loopback"]["intra"]["bytes_per_s"] > 0


def test_each_measured_cell_carries_its_mfu_waterfall(measured):
    """From the cell's own steps (`scalerl.perf.mfu_waterfall`): the timers cover the step within a few
    percent, and over two ranks the collectives' waits appear as communication and waiting for the other."""
    from scalerl.perf.mfu_waterfall import MfuWaterfall

    cells = {c["id"]: c for c in load_report(measured[0])["cells"] if c["status"] == "ok"}
    for cell in cells.values():
        waterfall = MfuWaterfall.from_json(cell["mfu_waterfall"])
        assert waterfall.check() == [], (cell["id"], waterfall.lines())
        assert waterfall.steps == 2 and 0 < waterfall.achieved_mfu < 1
    ddp = MfuWaterfall.from_json(cells["ddp|1x2|0M|none|default|colocated"]["mfu_waterfall"])
    assert ddp.seconds["comm"] > 0 and ddp.seconds["imbalance"] >= 0


def test_baselines_and_validation(measured):
    report = load_report(measured[0])
    base = report["baselines"]
    assert base["plain_update"]["ratio"] > 0 and base["plain_update"]["plain_s"]["n"] == 2
    gen = base.get("generate")
    if gen is not None:  # transformers is a test extra
        assert gen["hf_tokens_per_s"] > 0 and gen["tokens_per_round"] == 4 * 4 * 8  # one rank: 16 rows x 8
    rates = report["calibration"]["compute"]
    assert rates["train_flops_per_s"] > 0 and rates["gen_step_s"] >= 0 and "compute probe" in rates["source"]
    (entry,) = report["validation"]
    assert entry["cell"] == "ddp|1x2|0M|none|default|colocated"
    assert entry["projected"]["bytes_by_kind"]["grad"] == pytest.approx(entry["measured"]["bytes_per_step"], rel=0.02)
    assert entry["error"]["step"] is not None and "loopback" in entry["links"]["intra"]
    text = measured_tables(report)
    assert "MEASURED" in text and "baseline, plain PyTorch update" in text and "cost model vs measured" in text


def test_projection_and_compare(measured):
    report = load_report(measured[0])
    result = project(report, ProjectionTarget(nodes=[1, 2, 4], strategies=["ddp", "fsdp", "tp2+ddp"],
                                              devices_per_node=2))
    rows = {(r["strategy"], r["nodes"]): r for r in result["rows"]}
    assert rows[("ddp", 1)]["scaling_efficiency"] == pytest.approx(1.0)
    assert rows[("ddp", 4)]["devices"] == 8 and rows[("ddp", 4)]["tokens_per_s"] > 0
    text = projected_tables(result)
    assert text.startswith("PROJECTED") and "calibration: compute measured" in text
    assert "PROJECTED tokens/s by nodes x strategy" in text and "ideal (linear)" in text
    assert all(r["verdict"] == "within noise" for r in compare_reports(report, report))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--compare", str(measured[0]), str(measured[0])]) == 0
        assert main(["bench", "--project", "--report", str(measured[0]), "--nodes", "1,2", "--model",
                     "qwen2.5-7b", "--link", "ib-hdr", "--devices-per-node", "8", "--intra-link", "nvlink4",
                     "--device", "h100", "--mfu-train", "0.4", "--mfu-gen", "0.1"]) == 0
    assert "0 metric(s) worse" in out.getvalue() and "qwen2.5-7b" in out.getvalue()
    assert "assumed: H100 bf16 datasheet peak" in out.getvalue()


def test_emulated_nodes_need_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BenchError, match="2 nodes means emulated nodes.*needs root.*--nodes 1"):
        run_bench(BenchMatrix(strategies=["ddp"], nodes=[1, 2]), tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
