"""Ray launcher on one machine: a `ray.cluster_utils.Cluster` of two simulated nodes (2 logical CPUs each)
stands in for a cluster, so placement, cross-"node" rendezvous and failure reports are all exercised.
One Cluster serves the whole module: starting Ray is the expensive part."""

import json
import os
import sys
import time

import pytest

# Read by Ray when it is imported, so set here rather than in the fixture: no auth token written under
# ~/.ray, and addresses on 127.0.0.1 (tests below do not rely on which address Ray picks).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from scalerl.core.config import ConfigError  # noqa: E402
from scalerl.launch.ray_launcher import (  # noqa: E402
    PlacementError,
    RankFailure,
    create_rank_group,
    launch_ray,
    placement_problems,
    rank_bundles,
    run_on_ranks,
)
from tests.tiny import tiny_overrides  # noqa: E402

TINY = tiny_overrides("actor.ppo_mini_batch_size=8")


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The two simulated nodes of the root conftest's `ray_cluster`. The functions below run inside the
    actors; shipping them by value spares the workers from importing this test module (which they may not
    find on their sys.path)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_cluster


@pytest.fixture
def idle_cluster(cluster):
    """The cluster once every CPU is free again: Ray returns a removed group's resources a moment later,
    and best-effort SPREAD would meanwhile stack both ranks on the node that looks free."""
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"cluster still busy: {ray.available_resources()}"
        time.sleep(0.1)
    return cluster


# -------------------------------------------------- functions run inside the rank actors (pickled by name)
def rank_view(*_):
    """What a rank sees of itself: its node and the rendezvous variables it was given."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")
    return {"node_id": ray.get_runtime_context().get_node_id(), **{k: os.environ.get(k) for k in keys}}


def all_reduce_rank_ids(*_):
    """Stand-in for the distributed trainer: env:// rendezvous on gloo, then sum rank+1 over the world."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(),
                "node_id": ray.get_runtime_context().get_node_id()}
    finally:
        dist.destroy_process_group()


def fail_on_rank_one(cfg):
    if os.environ["RANK"] == "1":
        raise ValueError("boom on rank 1")
    time.sleep(300)  # rank 0 stuck as if in a collective: the launcher must not wait for it


def refuse_input_on_rank_one(cfg):
    from scalerl.data.errors import DataError

    if os.environ["RANK"] == "1":
        raise DataError("rows.jsonl, row 3: missing field 'answer'")
    time.sleep(300)


# ----------------------------------------------------------------------------------------------- tests
def test_placement_problems_name_the_mismatch():
    two_cpu_nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert placement_problems(rank_bundles(2, 0, 1.0), "STRICT_SPREAD", two_cpu_nodes) == []
    (gpu,) = [p for p in placement_problems(rank_bundles(1, 1, 1.0), "PACK", two_cpu_nodes) if "on one node" in p]
    assert "GPU" in gpu and "largest node has 0" in gpu
    assert placement_problems(rank_bundles(3, 0, 1.0), "SPREAD", two_cpu_nodes) == []  # SPREAD may stack
    assert "STRICT_SPREAD" in placement_problems(rank_bundles(3, 0, 0.5), "STRICT_SPREAD", two_cpu_nodes)[0]
    assert "STRICT_PACK" in placement_problems(rank_bundles(2, 0, 2.0), "STRICT_PACK", two_cpu_nodes)[0]
    # 16 GPUs in total, enough for 2 x 8, but only one node has 8 on it.
    uneven = [{"CPU": 64.0, "GPU": 8.0}, {"CPU": 64.0, "GPU": 4.0}, {"CPU": 64.0, "GPU": 4.0}]
    assert "only 1 of the 2 bundles fit" in placement_problems(rank_bundles(2, 8, 1.0), "PACK", uneven)[0]
    assert placement_problems(rank_bundles(5, 0, 0.4), "STRICT_PACK", [{"CPU": 2.0}]) == []  # 2.0 / 0.4 is 5


@pytest.mark.parametrize("strategy, distinct_nodes", [
    ("PACK", 1), ("STRICT_PACK", 1), ("SPREAD", 2), ("STRICT_SPREAD", 2)])
def test_strategy_puts_ranks_on_expected_nodes(idle_cluster, strategy, distinct_nodes):
    with create_rank_group(2, 0, 1.0, strategy, timeout_s=30) as group:
        views = run_on_ranks(group.actors, rank_view, timeout_s=60)
    assert [v["node_id"] for v in views] == group.node_ids
    assert len(set(group.node_ids)) == distinct_nodes
    assert [v["RANK"] for v in views] == ["0", "1"] and {v["WORLD_SIZE"] for v in views} == {"2"}
    local = [(v["LOCAL_RANK"], v["LOCAL_WORLD_SIZE"], v["GROUP_RANK"]) for v in views]
    assert local == ([("0", "2", "0"), ("1", "2", "0")] if distinct_nodes == 1 else [("0", "1", "0"), ("0", "1", "1")])
    rank0_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}[group.node_ids[0]]
    assert {(v["MASTER_ADDR"], v["MASTER_PORT"], v["OMP_NUM_THREADS"], v["GLOO_SOCKET_IFNAME"]) for v in views} == {
        (rank0_ip, group.env[0]["MASTER_PORT"], "1", "lo")}


def test_rank_group_all_reduces_across_two_nodes(idle_cluster):
    with create_rank_group(2, 0, 1.0, "STRICT_SPREAD", timeout_s=30) as group:
        results = run_on_ranks(group.actors, all_reduce_rank_ids, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    assert len({r["node_id"] for r in results}) == 2


def test_launch_ray_trains_at_world_two_across_nodes(idle_cluster, tmp_path, capsys):
    """The real GRPO trainer, data-parallel over two ranks on two "nodes", tiny model."""
    code = launch_ray(None, [*TINY, f"trainer.output_dir={tmp_path}"], num_nodes=2, gpus_per_node=0,
                      strategy="SPREAD", address=idle_cluster.address, timeout_s=30)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 rank(s) on 2 node(s) (SPREAD)" in out and "final metrics (rank 0)" in out
    assert "critic/score/mean = " in out and "actor/pg_loss = " in out and f"final_model: {tmp_path}" in out
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2
    assert ray.is_initialized()  # the caller's connection is left alone


def test_launch_ray_with_a_standalone_rollout_worker(idle_cluster, tmp_path, capsys):
    """One trainer rank and one rollout worker actor in its own placement group (the cluster's other node)."""
    code = launch_ray(None, [*TINY, "rollout.placement=standalone", f"trainer.output_dir={tmp_path}"], num_nodes=1,
                      gpus_per_node=0, strategy="SPREAD", address=idle_cluster.address, timeout_s=30)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 rank(s) on 2 node(s)" in out  # the worker landed on the other node
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["comm/weight_sync_bytes"] > 0


def test_launch_ray_reports_the_failing_rank_without_waiting_for_the_others(idle_cluster, capsys):
    started = time.monotonic()
    code = launch_ray(None, TINY, num_nodes=2, gpus_per_node=0, strategy="PACK", timeout_s=30,
                      train_fn=fail_on_rank_one)
    assert code == 1
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert "rank 1 failed" in err and "boom on rank 1" in err


def test_a_rank_refusing_its_input_is_reported_like_the_cli_does(idle_cluster, capsys):
    code = launch_ray(None, TINY, num_nodes=2, gpus_per_node=0, strategy="PACK", timeout_s=30,
                      train_fn=refuse_input_on_rank_one)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: rank 1: rows.jsonl, row 3: missing field 'answer'" in err and "Traceback" not in err


def test_launch_ray_restarts_the_job_from_the_latest_checkpoint_after_a_rank_is_killed(idle_cluster, tmp_path, capsys):
    """Rank 1 SIGKILLs itself after the step-2 checkpoint; with --max-restarts 1 the job restarts, continues
    from it, and ends with the weights of an uninterrupted run and each step logged exactly once."""
    from tests.launch.restart_helpers import (
        assert_same_final_weights,
        logged_steps,
        write_reward,
    )

    run = [*TINY, "trainer.total_steps=4", "trainer.save_every=2", "trainer.eval_every=0"]
    launch = lambda out, reward, restarts: launch_ray(  # noqa: E731
        None, [*run, reward, f"trainer.output_dir={out}"], num_nodes=2, gpus_per_node=0, strategy="SPREAD",
        timeout_s=60, max_restarts=restarts)
    assert launch(tmp_path / "straight", write_reward(tmp_path / "plain.py"), 0) == 0
    reward = write_reward(tmp_path / "killing.py", kill_after=tmp_path / "killed" / "checkpoints" / "step_00000002")
    assert launch(tmp_path / "killed", reward, 1) == 0
    err = capsys.readouterr().err
    # Either the killed rank's death or its peer's broken connection is reported first.
    assert " failed: " in err and "restarting the job (1/1) from its latest checkpoint" in err
    assert (tmp_path / "killing.killed").is_file()
    assert logged_steps(tmp_path / "killed") == [0, 1, 2, 3, 4]
    assert_same_final_weights(tmp_path / "straight", tmp_path / "killed")


def test_a_rank_failing_on_bad_input_is_not_restarted(idle_cluster, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # another run's outputs: refused, not retried
    code = launch_ray(None, [*TINY, f"trainer.output_dir={tmp_path}"], num_nodes=2, gpus_per_node=0, timeout_s=60,
                      max_restarts=2)
    assert code == 2  # bad input, as from the CLI
    err = capsys.readouterr().err
    assert "error: rank " in err and "holds another run's outputs" in err and "restarting" not in err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_impossible_requests_fail_up_front_naming_bundles_and_cluster(idle_cluster, capsys):
    started = time.monotonic()
    with pytest.raises(PlacementError) as gpus:
        create_rank_group(1, 1, 1.0, "PACK", timeout_s=30)
    message = str(gpus.value)
    assert "1 bundle(s) of {CPU 1, GPU 1}" in message
    assert "GPU: each bundle needs 1 on one node, the largest node has 0" in message
    assert "cluster resources: CPU 4, GPU 0" in message and "alive nodes (2)" in message
    with pytest.raises(PlacementError, match="STRICT_SPREAD puts each of the 3 bundles on its own node"):
        create_rank_group(3, 0, 1.0, "STRICT_SPREAD", timeout_s=30)
    assert launch_ray(None, TINY, num_nodes=2, gpus_per_node=2, timeout_s=30) == 2
    assert "GPU: 2 bundle(s) x 2 = 4 requested, the cluster has 0" in capsys.readouterr().err
    assert time.monotonic() - started < 10  # no placement group was ever waited on


def test_request_blocked_by_busy_resources_times_out_with_report(idle_cluster):
    holder = placement_group([{"CPU": 2.0}, {"CPU": 2.0}], strategy="STRICT_SPREAD")  # every CPU in the cluster
    try:
        assert holder.wait(timeout_seconds=30)
        started = time.monotonic()
        with pytest.raises(PlacementError) as busy:
            create_rank_group(1, 0, 1.0, "PACK", timeout_s=1)
        assert time.monotonic() - started < 10
    finally:
        remove_placement_group(holder)
    assert "not placed within 1 s" in str(busy.value) and "available now: CPU 0" in str(busy.value)
    # The group that waited in vain was removed, not left pending to grab the CPUs once they free up.
    assert {pg["state"] for pg in ray.util.placement_group_table().values()} == {"REMOVED"}


def test_bad_config_fails_before_ray_is_touched():
    with pytest.raises(ConfigError, match="actor.lrr"):
        launch_ray(None, ["actor.lrr=1"], num_nodes=1, gpus_per_node=0, address="127.0.0.1:1")
    with pytest.raises(ConfigError, match="strategy"):
        launch_ray(None, [], num_nodes=1, gpus_per_node=0, strategy="BEST", address="127.0.0.1:1")


def test_rank_failure_names_rank():
    assert str(RankFailure(3, ValueError("x"))) == "rank 3 failed: x"
