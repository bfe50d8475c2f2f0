"""`comm.allreduce=auto`: flat or hierarchical, from the node layout and the links' speeds, with a reason.

The rule (`HIERARCHY_RULE`) comes from a bandwidth model of the two algorithms with N nodes of L ranks
(n = N L, S bytes, grouped placement, one link per node):
- flat ring: each node's link carries 2(n-1)/n x S;
- hierarchical: 2(L-1)/L x S over intra-node links, then 2(N-1)/N x S over the link, in sequence.
Hierarchical is faster when  2(L-1)/L / B_intra < (2(n-1)/n - 2(N-1)/N) / B_inter,  which simplifies to
B_intra / B_inter > N. A margin on top covers what the model leaves out (per-step latency, the phases'
start-up). InfiniBand-class fabrics are left flat: they are within a small factor of intra-node speed,
and NCCL's own rings and trees already keep traffic on NVLink inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalerl.comm.gradients.hierarchical import NodeLayout
from scalerl.comm.net.cluster_topology import ClusterTopology


@dataclass(frozen=True)
class HierarchyRule:
    margin: float = 2.0  # required B_intra / B_inter is margin x nodes (the model's break-even is 1 x nodes)
    ib_class_kinds: tuple[str, ...] = ("infiniband", "roce")
    ib_class_min_mbit: int = 100_000  # any link this fast counts as InfiniBand-class
    # Intra-node bandwidth per rank, Mbit/s, where nothing better is known:
    nvlink_mbit_per_link: int = 200_000  # NVLink 3: 25 GB/s per link and direction
    pcie_mbit: int = 200_000  # PCIe 4.0 x16, ~25 GB/s achievable, for GPUs without NVLink
    cpu_loopback_mbit: int = 20_000  # gloo over loopback TCP on a server (6.8 Gbit/s measured on the 2-core dev host)


HIERARCHY_RULE = HierarchyRule()


@dataclass(frozen=True)
class AllReduceChoice:
    kind: str  # "flat" | "hierarchical"
    reason: str  # one line for the log

    @property
    def hierarchical(self) -> bool:
        return self.kind == "hierarchical"

    def metrics(self) -> dict[str, float]:
        return {"comm/allreduce/hierarchical": float(self.hierarchical)}


def intra_node_mbit(cluster: ClusterTopology | None, device_type: str, rule: HierarchyRule = HIERARCHY_RULE) -> tuple[float, str]:
    """An estimate of one rank's intra-node bandwidth and where it came from."""
    if device_type != "cuda":
        return rule.cpu_loopback_mbit, "CPU ranks: loopback TCP"
    records = cluster.records if cluster is not None else ()
    links = min((r.nvlink_active_links / max(len(r.gpus), 1) for r in records), default=0)
    if links >= 1:
        return links * rule.nvlink_mbit_per_link, f"NVLink, {links:g} active link(s) per GPU"
    return rule.pcie_mbit, "GPUs without NVLink: PCIe"


def inter_node_link(cluster: ClusterTopology | None, override_mbit: float) -> tuple[float | None, str, str]:
    """(Mbit/s or None when unknown, link kind, source) of the slowest node's best link."""
    if override_mbit > 0:
        return override_mbit, "configured", "comm.inter_node_mbit"
    if cluster is None:
        return None, "unknown", "no topology"
    best = [cluster.best_link(host) for host in cluster.nodes]
    if any(b is None for b in best):
        return None, "unknown", "a node's link speed is unreadable (virtual or down links)"
    slowest = min(best, key=lambda b: b.speed_mbit)
    return float(slowest.speed_mbit), slowest.kind, f"{slowest.name} on the topology"


def choose_allreduce(setting: str, layout: NodeLayout | None, cluster: ClusterTopology | None = None,
                     device_type: str = "cpu", inter_node_mbit: float = 0.0,
                     rule: HierarchyRule = HIERARCHY_RULE) -> AllReduceChoice:
    """`setting` is comm.allreduce: "flat", "hierarchical" (refused with the reason when the layout cannot
    run it) or "auto"."""
    if setting == "flat":
        return AllReduceChoice("flat", "comm.allreduce=flat")
    problem = layout.problem()
    if setting == "hierarchical":
        if problem is not None:
            raise ValueError(f"comm.allreduce=hierarchical cannot run on this layout: {problem}")
        return AllReduceChoice("hierarchical", f"comm.allreduce=hierarchical ({layout.describe()})")
    if setting != "auto":
        raise ValueError(f"comm.allreduce must be auto, flat or hierarchical, got {setting!r}")
    if layout.nodes == 1:
        return AllReduceChoice("flat", "auto: one node")
    if layout.ranks_per_node == 1:
        return AllReduceChoice("flat", "auto: one rank per node, nothing to reduce inside a node")
    if problem is not None:
        return AllReduceChoice("flat", f"auto: {problem}")
    inter, kind, source = inter_node_link(cluster, inter_node_mbit)
    if inter is None:
        return AllReduceChoice("flat", f"auto: inter-node link speed unknown ({source}); set comm.inter_node_mbit "
                                       "to let auto decide")
    if kind in rule.ib_class_kinds or inter >= rule.ib_class_min_mbit:
        return AllReduceChoice("flat", f"auto: InfiniBand-class fabric ({kind}, {inter:g} Mbit/s from {source})")
    intra, intra_source = intra_node_mbit(cluster, device_type, rule)
    needed = rule.margin * layout.nodes
    ratio = intra / inter
    verdict = "hierarchical" if ratio >= needed else "flat"
    return AllReduceChoice(verdict, f"auto: intra-node ~{intra:g} Mbit/s ({intra_source}) / inter-node {inter:g} "
                                    f"Mbit/s ({source}) = {ratio:.3g}x, {'>=' if ratio >= needed else '<'} "
                                    f"{rule.margin:g} x {layout.nodes} nodes = {needed:g}x -> {verdict} "
                                    f"({layout.describe()})")
