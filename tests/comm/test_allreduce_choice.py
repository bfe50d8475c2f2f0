"""comm.allreduce=auto picks flat or hierarchical from the node layout and the links, and says why;
explicit choices are honoured or refused with the reason; node layouts are checked."""

import pytest

from scalerl.comm.gradients.allreduce_choice import HIERARCHY_RULE, choose_allreduce
from scalerl.comm.gradients.hierarchical import NodeLayout
from scalerl.comm.net.cluster_topology import ClusterTopology
from scalerl.comm.net.topology import NetworkInterface, RankTopology


def cluster(nodes: int, per_node: int, kind: str = "ethernet", speed: int | None = 10_000, nvlink: int = 0):
    records = []
    for rank in range(nodes * per_node):
        iface = NetworkInterface("eth0", kind, speed, ("10.0.0.%d/24" % (rank // per_node + 1),))
        gpus = ("GPU",) * per_node if nvlink else ()
        records.append(RankTopology(f"node{rank // per_node}", rank, rank % per_node, (iface,), gpus=gpus,
                                    nvlink="present" if nvlink else "not present", nvlink_active_links=nvlink))
    return ClusterTopology.from_records(records)


def test_node_layout_blocks_and_problems():
    assert NodeLayout.blocks(4, 2).node_of_rank == (0, 0, 1, 1)
    assert NodeLayout.blocks(4, 2).problem() is None
    assert "not contiguous" in NodeLayout((0, 1, 0, 1)).problem()
    assert "different numbers" in NodeLayout((0, 0, 0, 1)).problem()
    with pytest.raises(ValueError, match="must divide"):
        NodeLayout.blocks(6, 4)


def test_auto_is_flat_on_one_node_or_one_rank_per_node():
    assert choose_allreduce("auto", NodeLayout.blocks(8, 8), cluster(1, 8)).reason == "auto: one node"
    choice = choose_allreduce("auto", NodeLayout.blocks(4, 1), cluster(4, 1))
    assert choice.kind == "flat" and "one rank per node" in choice.reason


def test_auto_is_flat_on_infiniband_class_fabric():
    choice = choose_allreduce("auto", NodeLayout.blocks(16, 8), cluster(2, 8, "infiniband", 200_000, nvlink=96),
                              device_type="cuda")
    assert choice.kind == "flat" and "InfiniBand-class" in choice.reason
    fast_ethernet = cluster(2, 8, "ethernet", 400_000)
    assert choose_allreduce("auto", NodeLayout.blocks(16, 8), fast_ethernet, device_type="cuda").kind == "flat"


def test_auto_goes_hierarchical_when_the_link_is_much_slower_than_inside_a_node():
    # 8 GPUs with 12 NVLinks each (96 on the node) against a 100 Gbit/s Ethernet link, 2 nodes: 24x >= 2 x 2
    choice = choose_allreduce("auto", NodeLayout.blocks(16, 8), cluster(2, 8, "ethernet", 100_000 - 1, nvlink=96),
                              device_type="cuda")
    assert choice.kind == "hierarchical", choice.reason
    assert "NVLink" in choice.reason and "-> hierarchical" in choice.reason
    assert choice.metrics() == {"comm/allreduce/hierarchical": 1.0}
    # CPU ranks over a 200 Mbit/s link (the emulated cluster): loopback is 100x faster
    emulated = choose_allreduce("auto", NodeLayout.blocks(4, 2), None, "cpu", inter_node_mbit=200)
    assert emulated.kind == "hierarchical" and "comm.inter_node_mbit" in emulated.reason


def test_auto_stays_flat_when_the_ratio_does_not_beat_the_node_count():
    # PCIe GPUs (200 Gbit/s assumed) over 25 Gbit/s: 8x; with 8 nodes the rule needs 2 x 8 = 16x
    choice = choose_allreduce("auto", NodeLayout.blocks(64, 8), cluster(8, 8, "ethernet", 25_000), device_type="cuda")
    assert choice.kind == "flat" and f"{HIERARCHY_RULE.margin:g} x 8 nodes" in choice.reason
    assert choose_allreduce("auto", NodeLayout.blocks(16, 8), cluster(2, 8, "ethernet", 25_000),
                            device_type="cuda").kind == "hierarchical"


def test_unknown_link_speed_leaves_auto_flat_and_says_how_to_fix_it():
    choice = choose_allreduce("auto", NodeLayout.blocks(4, 2), cluster(2, 2, speed=None))
    assert choice.kind == "flat" and "set comm.inter_node_mbit" in choice.reason


def test_explicit_choices():
    layout = NodeLayout.blocks(4, 2)
    assert choose_allreduce("flat", None).kind == "flat"
    assert choose_allreduce("hierarchical", layout).kind == "hierarchical"
    with pytest.raises(ValueError, match="not contiguous"):
        choose_allreduce("hierarchical", NodeLayout((0, 1, 0, 1)))
    auto = choose_allreduce("auto", NodeLayout((0, 1, 0, 1)), inter_node_mbit=100)
    assert auto.kind == "flat" and "not contiguous" in auto.reason
