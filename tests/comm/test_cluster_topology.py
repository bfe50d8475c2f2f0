"""ClusterTopology from per-rank records; gather_topology over a real gloo group of two processes."""

from scalerl.comm.net.cluster_topology import ClusterTopology
from scalerl.comm.net.topology import NetworkInterface, RankTopology
from tests.spawned_group import run_in_group

LO = NetworkInterface("lo", "loopback", None, ("127.0.0.1/8",))


def record(host, rank, *interfaces):
    return RankTopology(hostname=host, rank=rank, local_rank=0, interfaces=(LO, *interfaces))


def eth(name, speed, kind="ethernet", **kw):
    return NetworkInterface(name, kind, speed, ("10.0.0.1/24",), **kw)


def test_nodes_placement_and_slowest_link():
    fast, slow = eth("ib0", 200000, "infiniband"), eth("ens5", 25000)
    docker = eth("docker0", 100000, "virtual", virtual_kind="bridge")  # faster, but virtual: ignored
    records = [record("a", 0, fast, slow), record("a", 1, fast, slow), record("b", 2, slow, docker),
               record("b", 3, slow, docker)]
    cluster = ClusterTopology.from_records(reversed(records))
    assert cluster.nodes == ["a", "b"] and cluster.world_size == 4
    assert cluster.ranks_per_node == {"a": [0, 1], "b": [2, 3]} and cluster.contiguous
    assert cluster.best_link("a").name == "ib0" and cluster.best_link("b").name == "ens5"
    assert cluster.slowest_inter_node_mbit == 25000
    text = cluster.summary()
    assert "4 ranks on 2 node(s); ranks per node contiguous" in text
    assert "a: ranks 0-1; best link ib0 infiniband 200 Gbit/s" in text
    assert "docker0: virtual (bridge)" in text and "slowest inter-node link: 25 Gbit/s" in text


def test_interleaved_ranks_and_unknown_speed():
    records = [record("a", 0, eth("ens5", 25000)), record("b", 1, eth("ens5", None)),
               record("a", 2, eth("ens5", 25000)), record("b", 3, eth("ens5", None))]
    cluster = ClusterTopology.from_records(records)
    assert cluster.ranks_per_node == {"a": [0, 2], "b": [1, 3]} and not cluster.contiguous
    assert cluster.slowest_inter_node_mbit is None
    assert "NOT contiguous" in cluster.summary() and "unknown" in cluster.summary()


def _gather(rank):
    from scalerl.comm.net.cluster_topology import gather_topology
    from scalerl.comm.net.topology import detect_topology

    # Rank 1 pretends to be another host with a longer record, so padding and lengths are exercised.
    mine = detect_topology(env={"RANK": str(rank), "LOCAL_RANK": "0"}, detect_gpus=False)
    if rank == 1:
        mine = RankTopology(hostname="other-host", rank=1, local_rank=0,
                            interfaces=mine.interfaces + (eth("ens5", 25000),))
    return gather_topology(record=mine).to_json_records()


def test_gather_topology_over_gloo():
    results = run_in_group(_gather, 2, timeout_s=120)
    assert results[0] == results[1]
    cluster = ClusterTopology.from_json_records(results[0])
    assert cluster.ranks_per_node == {cluster.records[0].hostname: [0], "other-host": [1]}
    assert cluster.node_record("other-host").interface("ens5").speed_mbit == 25000
