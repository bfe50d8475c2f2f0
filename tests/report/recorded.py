"""The recorded benchmark report the report tests render (tests/report/recorded_report.json: `scalerl bench
--strategies ddp,fsdp --nodes 1,2 --rate-mbit 200 --weight-sync colocated,full,delta --steps 5 --warmup 2`
on the 2-core development machine), optionally with a doctor report embedded (recorded facts from
tests/health/recorded_measurements.py), a PNG blankness measure, and how the tests start headless Chromium."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

RECORDED = Path(__file__).with_name("recorded_report.json")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
PNG_MIN_STD = 3.0  # grey-level standard deviation: a blank page is ~0, a page with text or a plot is > 10


def doctor_json() -> dict:
    from scalerl.doctor.report import DoctorReport
    from scalerl.health import run_cluster_rules
    from tests.health.recorded_measurements import (
        healthy_cluster_measurements,
        healthy_facts,
    )

    facts, measured = healthy_facts(nodes=2), healthy_cluster_measurements()
    world = {"world_size": 4, "joined": [0, 1, 2, 3], "missing": [], "launcher": "torchrun",
             "nodes": {"node0": [0, 1], "node1": [2, 3]}}
    return DoctorReport(["distributed-check"], run_cluster_rules(facts, measured), facts, measured, world).to_json()


def recorded_report_path(tmp_path: Path, with_doctor: bool = True) -> Path:
    report = json.loads(RECORDED.read_text())
    if with_doctor:
        report["doctor"] = doctor_json()
    path = tmp_path / "benchmark_report.json"
    path.write_text(json.dumps(report))
    return path


def png_std(path: Path) -> float:
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(path).convert("L")).stddev[0]
