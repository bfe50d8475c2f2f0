"""`--distributed-check` at world 4 on gloo, by fault injection: one spawned group of 4 processes runs the
doctor five times (a fresh rendezvous each time): healthy; rank 1 reporting another torch; rank 2 with
GLOO_SOCKET_IFNAME naming a missing interface; a world of 5 whose rank 4 never starts; and once inside a
process group that already exists. Each run must land its fault on its leaf and raise no other fault; the
healthy runs raise nothing at all."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from scalerl.core.net import free_port
from tests.spawned_group import run_in_group

SCENARIOS = ("healthy", "versions", "socket", "missing", "existing")


def _diagnose(port: int, output_dir: str, join_timeout_s: float = 30, **changes) -> dict:
    from scalerl.doctor.diagnose import DoctorOptions, diagnose

    saved = {k: os.environ.get(k) for k in ("MASTER_PORT", *changes)}
    os.environ.update({"MASTER_PORT": str(port), **changes})
    try:
        options = DoctorOptions(max_size=2**20, iters=2, join_timeout_s=join_timeout_s, timeout_s=120,
                                overrides=[f"trainer.output_dir={output_dir}"], scratch_dir=output_dir)
        code, report = diagnose(options)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return {"code": code, "report": report.to_json() if report is not None else None}


def _scenarios(rank: int, ports: list[int], output_dir: str) -> dict:
    import torch

    out = {"healthy": _diagnose(ports[0], output_dir)}
    with mock.patch.object(torch, "__version__", "2.5.1+cu121" if rank == 1 else torch.__version__):
        out["versions"] = _diagnose(ports[1], output_dir)
    out["socket"] = _diagnose(ports[2], output_dir, **({"GLOO_SOCKET_IFNAME": "nosuch0"} if rank == 2 else {}))
    # Rank 4 of a world of 5 is never started: the others must go on without it and name it.
    out["missing"] = _diagnose(ports[3], output_dir, join_timeout_s=5, WORLD_SIZE="5", LOCAL_WORLD_SIZE="5")
    # Inside a process group someone else started (a training script calling the doctor): used as it is.
    os.environ["MASTER_PORT"] = str(ports[4])
    torch.distributed.init_process_group("gloo", init_method="env://")
    try:
        out["existing"] = _diagnose(ports[4], output_dir)
        out["existing"]["still_initialized"] = torch.distributed.is_initialized()
    finally:
        torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("doctor") / "run")
    ports = [free_port() for _ in SCENARIOS]
    results = run_in_group(_scenarios, 4, ports, output_dir, timeout_s=900, init_group=False)
    return {name: [r[name] for r in results] for name in SCENARIOS}


def alarms(report: dict) -> dict[str, str]:
    return {leaf["id"]: leaf["status"] for branch in report["tree"] for leaf in branch["leaves"]
            if leaf["status"] in ("warning", "fault")}


def findings(report: dict, leaf_id: str) -> list[dict]:
    return [f for branch in report["tree"] for leaf in branch["leaves"] if leaf["id"] == leaf_id
            for f in leaf["findings"]]


def test_healthy_world_of_four_raises_nothing(runs):
    ranks = runs["healthy"]
    assert [r["code"] for r in ranks] == [0, 0, 0, 0]
    report = ranks[0]["report"]
    assert [r["report"] for r in ranks[1:]] == [None, None, None]  # rank 0 reports
    assert alarms(report) == {}, alarms(report)
    assert report["schema"] == "scalerl.doctor/1" and report["world"]["joined"] == [0, 1, 2, 3]
    assert [f["rank"] for f in report["ranks"]] == [0, 1, 2, 3]
    sweep = report["measurements"]["bandwidth"]["sweeps"][0]
    assert sweep["scope"] == "intra-node" and sweep["ranks"] == [0, 1, 2, 3]
    (result,) = sweep["results"]
    assert result["busbw"] == pytest.approx(result["algbw"] * 2 * 3 / 4) and result["time_s"] > 0
    shared = report["measurements"]["shared"]["paths"]
    assert {p["role"] for p in shared} == {"output", "checkpoint"}


def test_a_rank_with_another_torch_is_a_version_mismatch(runs):
    ranks = runs["versions"]
    assert [r["code"] for r in ranks] == [1, 1, 1, 1]  # every rank exits with the fault
    report = ranks[0]["report"]
    assert alarms(report) == {"communication/library_versions": "fault"}
    (f,) = [f for f in findings(report, "communication/library_versions") if f["status"] == "fault"]
    assert f["ranks"] == [1] and "2.5.1+cu121 on rank(s) 1" in f["summary"]


def test_a_missing_socket_interface_is_named_and_the_check_still_runs(runs):
    report = runs["socket"][0]["report"]
    assert alarms(report) == {"communication/topology": "fault"}
    (f,) = [f for f in findings(report, "communication/topology") if f["status"] == "fault"]
    assert f["ranks"] == [2] and "GLOO_SOCKET_IFNAME=nosuch0" in f["summary"] and "GLOO_SOCKET_IFNAME=" in f["fix"]
    assert report["measurements"]["bandwidth"]["sweeps"]  # the doctor's own group used a working interface


def test_inside_an_existing_process_group(runs):
    ranks = runs["existing"]
    assert [(r["code"], r["still_initialized"]) for r in ranks] == [(0, True)] * 4
    report = ranks[0]["report"]
    assert alarms(report) == {} and report["world"]["joined"] == [0, 1, 2, 3]
    assert report["measurements"]["bandwidth"]["sweeps"][0]["ranks"] == [0, 1, 2, 3]


def test_a_rank_that_never_joins_is_named_with_its_host(runs):
    ranks = runs["missing"]
    assert [r["code"] for r in ranks] == [1, 1, 1, 1]
    report = ranks[0]["report"]
    assert alarms(report) == {"communication/topology": "fault"}
    assert report["world"]["joined"] == [0, 1, 2, 3] and [m["rank"] for m in report["world"]["missing"]] == [4]
    (f,) = [f for f in findings(report, "communication/topology") if f["status"] == "fault"]
    host = report["ranks"][0]["hostname"]
    assert f["ranks"] == [4] and f"rank 4 from {host}" in f["summary"]
    assert report["measurements"]["bandwidth"]["sweeps"][0]["ranks"] == [0, 1, 2, 3]  # measured without it


def test_a_store_that_never_answers_ends_the_join_at_its_deadline(monkeypatch):
    """The doctor meets at the trainer's store (`scalerl.parallel.rendezvous.connect_store`): a constructor
    that hangs despite its timeout ends in RendezvousError after the join timeout plus the grace."""
    import threading
    import time

    import torch.distributed as dist

    from scalerl.core.rank_env import RankEnv
    from scalerl.doctor.world import RendezvousError, join_world
    from scalerl.parallel import rendezvous

    release = threading.Event()
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: release.wait())
    monkeypatch.setattr(rendezvous, "STORE_GRACE_S", 0.5)
    env = RankEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=free_port(), launcher="torchrun")
    start = time.monotonic()
    try:
        with pytest.raises(RendezvousError, match="rank 1: the rendezvous at 127.0.0.1:.* did not answer within 1 s"):
            join_world(env, {"rank": 1}, join_timeout_s=1.0, collective_timeout_s=10, backend="gloo", environ={})
    finally:
        release.set()
    assert 1.5 <= time.monotonic() - start < 4.5
