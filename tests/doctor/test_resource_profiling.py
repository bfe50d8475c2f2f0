"""`--performance-profiling` in one process on the tiny model, by fault injection for the host-RAM,
checkpoint-cost and phase-switch-memory leaves: healthy (none raised, with a plan beside it); a slow disk
(the checkpoint writer throttled per byte written); a memory cap (a container limit read through a fake
cgroup file) with a generation that allocates two thirds of it; the same cap tightened to the run's own peak.
Each run is a few seconds; the rules' thresholds are tested on recorded numbers in
tests/health/test_resource_rules.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from scalerl.doctor import host_memory
from tests.doctor.test_plan_comparison import PLAN
from tests.tiny import tiny_overrides

# 1000 steps saved every 20: the cost of a save counts against 20 steps, over 50 saves.
RUN = tiny_overrides("trainer.save_every=20", "trainer.total_steps=1000")
LEAVES = ("resources/host_ram", "resources/checkpoint_cost", "resources/phase_switch_memory")
DISK_BYTES_PER_S = 100 * 2**10  # the slow disk: ~270 KiB of tiny state takes ~2.7 s


def _profile(scratch: Path, plan: Path | None = None) -> dict:
    from scalerl.doctor.diagnose import DoctorOptions, diagnose

    options = DoctorOptions(distributed_check=False, profile=True, overrides=RUN, steps=2, warmup=1,
                            scratch_dir=str(scratch), timeout_s=300, plan_path=str(plan) if plan else None)
    _, report = diagnose(options, environ={})
    return report.to_json()


def findings(report: dict) -> dict[str, dict]:
    """Leaf -> its worst finding."""
    return {leaf["id"]: leaf["findings"][0] for branch in report["tree"] for leaf in branch["leaves"]}


def alarms(report: dict) -> dict[str, str]:
    return {leaf["id"]: leaf["status"] for branch in report["tree"] for leaf in branch["leaves"]
            if leaf["status"] in ("warning", "fault")}


def _throttled(write):
    """A checkpoint writer on a disk that takes ``DISK_BYTES_PER_S``: each file's bytes, once written, sleep."""
    def slow(*args, **kwargs):
        result = write(*args, **kwargs)
        file = Path(args[-1] if write.__name__ != "write_durably" else args[0])
        time.sleep(file.stat().st_size / DISK_BYTES_PER_S)
        return result

    return slow


def _slow_disk():
    from scalerl.checkpoint import local

    return [mock.patch.object(local, name, _throttled(getattr(local, name)))
            for name in ("fsync_file", "save_torch_state", "write_durably")]


def _memory_cap(tmp_path: Path, gib: float):
    limit = tmp_path / "memory.max"
    limit.write_text(str(int(gib * 2**30)))
    return mock.patch.object(host_memory, "CGROUP_LIMITS", (limit,))


def _generation_allocating(gib: float):
    """Generation holds ``gib`` more host memory while it runs (pages touched), as a larger KV cache would."""
    from scalerl.rollout.engines.builtin import BuiltinEngine

    original = BuiltinEngine.generate

    def generate(self, *args, **kwargs):
        held = torch.ones(int(gib * 2**30) // 4)
        try:
            return original(self, *args, **kwargs)
        finally:
            del held

    return mock.patch.object(BuiltinEngine, "generate", generate)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resources")
    plan = tmp / "plan.json"  # with a plan, as `scalerl plan --json` writes it: planned vs measured
    plan.write_text(json.dumps(PLAN))
    out = {"healthy": _profile(tmp / "healthy", plan)}
    record = out["healthy"]["measurements"]["profile"]["per_rank"][0]
    peak = max([p["peak_gb"] for p in record["phases"].values()] + list(record["host_ram"].values()))
    out["peak_gb"] = peak
    patches = _slow_disk()
    for p in patches:
        p.start()
    try:
        out["slow_disk"] = _profile(tmp / "slow_disk")
    finally:
        for p in patches:
            p.stop()
    # generation adds twice what the run holds: the cap's last two thirds, over the process's own first third
    with _memory_cap(tmp, 3 * peak), _generation_allocating(2 * peak):
        out["generation_over_cap"] = _profile(tmp / "generation_over_cap")
    with _memory_cap(tmp, 1.01 * peak):
        out["capped"] = _profile(tmp / "capped")
    return out


def test_healthy_run_raises_none_of_the_resource_leaves(runs):
    report = runs["healthy"]
    found = findings(report)
    assert {leaf: found[leaf]["status"] for leaf in LEAVES} == dict.fromkeys(LEAVES, "ok"), [found[x] for x in LEAVES]
    assert alarms(report) == {}, alarms(report)
    record = report["measurements"]["profile"]["per_rank"][0]
    assert set(record["host_ram"]) == {"load", "checkpoint", "export"}
    assert all(v > 0 for v in record["host_ram"].values())
    assert record["save_s"] > 0 and record["node_memory_source"] == "MemTotal"
    assert found["resources/phase_switch_memory"]["evidence"]["switch"] == "update_actor -> gen"
    rows = {r["phase"]: r for r in report["measurements"]["profile"]["plan"]["rows"]}
    assert rows["generation"]["measured_s"] > 0 and rows["update"]["measured_gb"] > 0
    assert rows["checkpoint_save"]["measured_s"] == record["save_s"]


def test_a_slow_disk_is_the_checkpoint_cost_alone(runs):
    report = runs["slow_disk"]
    assert alarms(report) == {"resources/checkpoint_cost": alarms(report).get("resources/checkpoint_cost")}
    f = findings(report)["resources/checkpoint_cost"]
    assert f["status"] in ("warning", "fault") and f["evidence"]["save_s"] > 2.0
    assert f["evidence"]["save_every"] == 20 and "trainer.save_every=" in f["fix"]
    suggested = int(f["fix"].split("trainer.save_every=")[1].split()[0])
    assert suggested > 20


def test_generation_over_the_cap_is_named_at_the_switch_into_it(runs):
    report = runs["generation_over_cap"]
    f = findings(report)["resources/phase_switch_memory"]
    assert f["status"] == "fault" and f["evidence"]["switch"] == "update_actor -> gen", f
    assert f["evidence"]["added_gb"] > 1.6 * runs["peak_gb"]
    assert f["fix"].startswith("fewer rows decoding at once (rollout.max_num_seqs)")
    # On a CPU the same peak is the device memory's; load, checkpoint and export still fit the node.
    assert set(alarms(report)) == {"resources/phase_switch_memory", "resources/accelerator_memory"}
    assert findings(report)["resources/host_ram"]["evidence"]["source"] == "cgroup limit"


def test_a_memory_cap_at_the_runs_own_peak_is_a_host_ram_fault(runs):
    report = runs["capped"]
    f = findings(report)["resources/host_ram"]
    assert f["status"] in ("warning", "fault") and f["evidence"]["phase"] in ("load", "checkpoint", "export")
    assert f["evidence"]["source"] == "cgroup limit" and f["evidence"]["fraction"] > 0.8
    assert f"at {f['evidence']['phase']} time" in f["summary"] and f["fix"]
    assert report["exit_code"] == (1 if "fault" in alarms(report).values() else 0)
