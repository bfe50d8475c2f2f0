"""Rank placement: each node's ranks contiguous in the mesh, tp innermost, and what the log says."""

import torch

from scalerl.comm.net.cluster_topology import ClusterTopology
from scalerl.comm.net.rank_placement import (
    node_contiguous_order,
    plan_rank_placement,
    ring_crossings,
)
from scalerl.comm.net.topology import NetworkInterface, RankTopology

INTERLEAVED = ["a", "b", "a", "b"]  # rank r on node r % 2, as a launcher with the wrong order does


def test_interleaved_ranks_are_grouped_by_node():
    assert node_contiguous_order(INTERLEAVED) == [0, 2, 1, 3]
    assert node_contiguous_order(["b", "a", "a", "b", "c", "c"]) == [0, 3, 1, 2, 4, 5]  # nodes by lowest rank
    assert ring_crossings([0, 1, 2, 3], INTERLEAVED) == 4 and ring_crossings([0, 2, 1, 3], INTERLEAVED) == 2


def test_grouped_ranks_stay_as_they_are():
    placement = plan_rank_placement(["a", "a", "b", "b"], tp=2)
    assert placement.order == (0, 1, 2, 3) and not placement.changed and placement.notes == ()


def test_plan_keeps_tp_within_a_node_and_says_what_it_did():
    nodes = ["a", "b"] * 4  # 2 nodes x 4 ranks, interleaved
    placement = plan_rank_placement(nodes, tp=2)
    assert placement.changed and placement.order == (0, 2, 4, 6, 1, 3, 5, 7)
    mesh = torch.tensor(placement.order).view(1, 4, 1, 2)  # (pp, dp_replicate, dp_shard, tp)
    for tp_group in mesh.reshape(-1, 2).tolist():
        assert len({nodes[r] for r in tp_group}) == 1, tp_group
    for dp_group in mesh[0, :, 0, :].T.tolist():  # a DP ring per TP rank: crosses nodes twice, not 4 times
        assert ring_crossings(dp_group, nodes) == 2
    note = placement.notes[0]
    assert "not contiguous per node (a: 0,2,4,6; b: 1,3,5,7)" in note
    assert "[0, 2, 4, 6, 1, 3, 5, 7]" in note and "crosses nodes 2 times instead of 8" in note


def test_tp_that_does_not_divide_a_node_is_reported():
    placement = plan_rank_placement(["a", "a", "a", "b", "b", "b"], tp=2)
    assert not placement.changed
    assert "parallel.tp=2 does not divide the rank count of node(s) a, b" in placement.notes[0]


def _record(host, rank, address):
    lo = NetworkInterface("lo", "loopback", None, ("127.0.0.1/8",))
    link = NetworkInterface(f"veth{rank % 2}", "virtual", 10000, (address,), virtual_kind="veth")
    return RankTopology(hostname=host, rank=rank, local_rank=rank // 2, interfaces=(lo, link))


def test_network_namespaces_of_one_host_are_separate_nodes():
    # The emulated cluster: one hostname, a network namespace (own address) per node, ranks interleaved.
    records = [_record("box", r, f"10.9.0.{r % 2 + 1}/24") for r in range(4)]
    cluster = ClusterTopology.from_records(records)
    assert cluster.node_of_rank == ["box[10.9.0.1/24]", "box[10.9.0.2/24]"] * 2
    assert cluster.ranks_per_node == {"box[10.9.0.1/24]": [0, 2], "box[10.9.0.2/24]": [1, 3]}
    assert not cluster.contiguous
    assert plan_rank_placement(cluster.node_of_rank).order == (0, 2, 1, 3)
    # Distinct hostnames keep their plain names.
    other = ClusterTopology.from_records([_record("a", 0, "10.9.0.1/24"), _record("b", 1, "10.9.0.1/24")])
    assert other.nodes == ["a", "b"]
