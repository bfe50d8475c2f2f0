"""The links a projection is calibrated with (`scalerl.bench.calibration.links_for`): without any inter-node
measurement the inter-node link is the intra-node one, and its source says so rather than naming an
intra-node preset (a PCIe link) as what joins the nodes."""

from __future__ import annotations

from scalerl.bench.calibration import links_for


def test_an_unmeasured_inter_node_link_says_it_was_taken_from_the_intra_node_one():
    links = links_for({"links": {}})  # one node, no loopback probe: the intra-node link is the PCIe preset
    assert links.inter.bytes_per_s == links.intra.bytes_per_s
    assert links.inter.source.startswith("none measured, so taken as fast as the intra-node link (nominal PCIe")
    assert links.inter.source.endswith("measure one with scalerl bench --nodes 2 (emulated nodes) or name one: --link")
