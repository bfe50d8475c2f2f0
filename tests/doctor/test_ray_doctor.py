"""`scalerl doctor --ray`: the distributed check and the profile on Ray rank actors of a two-"node"
`ray.cluster_utils.Cluster` (one machine), and placement groups explained: one that can never be placed, and the doctor's own request
when the cluster cannot hold it. One small cluster for the module (starting Ray is the expensive part)."""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.util.placement_group import placement_group, remove_placement_group

from scalerl.doctor.diagnose import DoctorOptions
from scalerl.doctor.ray_doctor import diagnose_on_ray, pending_placement_groups
from tests.tiny import tiny_overrides

TINY = tiny_overrides("data.num_train=100", "data.num_val=4")


def _options(tmp_path, profile=False):
    return DoctorOptions(max_size=2**20, iters=2, join_timeout_s=60, timeout_s=120, profile=profile, steps=2,
                         warmup=1, overrides=[*TINY, f"trainer.output_dir={tmp_path / 'run'}"], scratch_dir=str(tmp_path))


def _alarms(report):
    return {leaf["id"]: leaf["status"] for b in report.tree() for leaf in b["leaves"]
            if leaf["status"] in ("warning", "fault")}


def test_check_on_rank_actors_explains_a_pending_placement_group(ray_cluster, tmp_path):
    stuck = placement_group([{"CPU": 100.0}], strategy="PACK", name="too-big")  # can never be placed
    try:
        report = diagnose_on_ray(_options(tmp_path, profile=True), num_nodes=2, gpus_per_node=0, cpus_per_rank=1.0,
                                 strategy="SPREAD", address=None)
    finally:
        remove_placement_group(stuck)
    assert report.world["joined"] == [0, 1] and report.world["launcher"] == "ray"
    assert _alarms(report) == {"communication/topology": "fault"} and report.exit_code == 1
    (f,) = [f for f in report.findings if f.rule == "ray_placement" and f.status == "fault"]
    assert "too-big" in f.summary and "CPU: 1 bundle(s) x 100 = 100 requested, the cluster has 4" in f.summary
    assert report.measurements["bandwidth"]["sweeps"][0]["ranks"] == [0, 1]
    assert [r["rank"] for r in report.measurements["profile"]["per_rank"]] == [0, 1]  # both modes ran on the actors
    assert pending_placement_groups()["pending"] == []


def test_the_doctors_own_request_that_cannot_be_placed(ray_cluster, tmp_path):
    report = diagnose_on_ray(_options(tmp_path), num_nodes=1, gpus_per_node=1, cpus_per_rank=1.0, strategy="PACK",
                             address=None)
    assert report.exit_code == 1
    (f,) = [f for f in report.findings if f.status == "fault"]
    assert f.leaf == "communication/topology" and "cannot be placed" in f.summary
    assert "GPU: each bundle needs 1 on one node, the largest node has 0" in f.evidence["report"]
