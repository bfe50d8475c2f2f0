"""The report as people and programs read it: every leaf present, JSON round trip with the documented
keys, the rendered tree, and docs/doctor.md in step with the rules (recorded measurements, no spawning)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from scalerl.doctor.render import render
from scalerl.doctor.report import SCHEMA, DoctorReport
from scalerl.health import LEAVES, RULES, describe_rules, run_cluster_rules
from tests.health.recorded_measurements import (
    healthy_cluster_measurements,
    healthy_facts,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "doctor.md"
TOP_KEYS = {"schema", "created", "scalerl_version", "modes", "status", "exit_code", "world", "tree", "ranks",
            "measurements"}


def _report(torch_on_rank_1: str | None = None) -> DoctorReport:
    facts = healthy_facts(nodes=2)
    if torch_on_rank_1:
        facts[1]["versions"]["torch"] = torch_on_rank_1
    measured = healthy_cluster_measurements()
    return DoctorReport(["distributed-check"], run_cluster_rules(facts, measured), facts, measured,
                        {"world_size": 4, "joined": [0, 1, 2, 3], "missing": [], "launcher": "torchrun",
                         "nodes": {"node0": [0, 1], "node1": [2, 3]}})


def test_json_has_every_leaf_and_round_trips(tmp_path):
    report = _report()
    data = json.loads(report.write(tmp_path / "r.json").read_text())
    assert set(data) == TOP_KEYS and data["schema"] == SCHEMA and data["exit_code"] == 0
    leaves = {leaf["id"]: leaf for branch in data["tree"] for leaf in branch["leaves"]}
    assert set(leaves) == set(LEAVES)
    unmeasured = leaves["compute/data_sharding"]
    assert unmeasured["status"] == "not measured" and unmeasured["findings"][0]["rule"] == "coverage"
    again = DoctorReport.from_json(data)
    assert again.to_json()["tree"] == data["tree"] and again.exit_code == 0


def test_fault_sets_status_exit_code_and_the_printed_tree():
    report = _report(torch_on_rank_1="2.5.1")
    assert report.status == "fault" and report.exit_code == 1
    out = io.StringIO()
    render(report, out)
    text = out.getvalue()
    assert "scalerl doctor [FAULT]" in text and "library version mismatch [FAULT]" in text
    assert "fix: install the same version on every node" in text and "exit code 1" in text
    assert re.search(r"node0\s+0,1", text) and "all-reduce sweep" in text and "node pairs" in text


def test_docs_name_every_leaf_and_rule_and_show_the_rules_table():
    docs = DOCS.read_text()
    for leaf in LEAVES.values():
        assert leaf.title in docs, leaf.title
    for rule_id in RULES:
        assert rule_id in docs, rule_id
    assert describe_rules() in docs  # the table at the end is the data, not a copy drifting from it
    for key in TOP_KEYS:
        assert f'"{key}"' in docs, key
