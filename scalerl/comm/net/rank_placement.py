"""Where each rank sits in the device mesh: every node's ranks contiguous, so rings cross nodes rarely.

A ring collective (gloo's all-reduce, NCCL's ring) passes data from each group member to the next in
group-rank order. When a launcher numbers ranks across nodes in turn (node a: 0, 2; node b: 1, 3), a ring
over ranks 0-1-2-3 crosses the inter-node link at every hop: 4 crossings where 2 would do, and twice the
bytes over the slowest link (measured 2.2x slower on the emulated network, docs/comm-accounting.md).

The fix keeps the launcher's ranks and changes the mesh: positions in the ``(pp, dp_replicate, dp_shard,
tp)`` mesh are filled node by node (nodes in the order of their lowest rank, ranks ascending within a
node). ``tp`` is the innermost dimension, so TP groups stay within a node whenever the node's rank count
divides by ``tp``; a DP group then visits each node's members consecutively, and its ring crosses each
node boundary once. The mesh's groups must keep that order (`ParallelDims.build_mesh`): torch's
``new_group`` sorts ranks unless told not to, which would undo it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RankPlacement:
    order: tuple[int, ...]  # mesh position i holds global rank order[i]
    notes: tuple[str, ...] = ()  # what was done and why, for the log

    @property
    def changed(self) -> bool:
        return self.order != tuple(range(len(self.order)))


def node_contiguous_order(rank_nodes: Sequence[str]) -> list[int]:
    """Ranks grouped by node (``rank_nodes[r]`` is rank r's node), nodes in the order of their lowest
    rank, ranks ascending within a node."""
    nodes = list(dict.fromkeys(rank_nodes))
    return [r for node in nodes for r in range(len(rank_nodes)) if rank_nodes[r] == node]


def ring_crossings(ring: Sequence[int], rank_nodes: Sequence[str]) -> int:
    """Hops of the ring ``ring[0] -> ring[1] -> ... -> ring[0]`` that go from one node to another."""
    if len(ring) < 2:
        return 0
    return sum(rank_nodes[a] != rank_nodes[b] for a, b in zip(ring, [*ring[1:], ring[0]]))


def plan_rank_placement(rank_nodes: Sequence[str], tp: int = 1) -> RankPlacement:
    """The mesh order for ranks on ``rank_nodes`` (see the module docstring), with notes for the log."""
    world = len(rank_nodes)
    order = tuple(node_contiguous_order(rank_nodes))
    notes = []
    if order != tuple(range(world)):
        per_node = {node: [r for r in range(world) if rank_nodes[r] == node] for node in dict.fromkeys(rank_nodes)}
        listing = "; ".join(f"{node}: {_ranks(ranks)}" for node, ranks in per_node.items())
        notes.append(f"the launcher's ranks are not contiguous per node ({listing}); the device mesh is "
                     f"built in node order {list(order)}: a ring over all ranks crosses nodes "
                     f"{ring_crossings(order, rank_nodes)} times instead of "
                     f"{ring_crossings(range(world), rank_nodes)}")
    split = sorted(node for node, count in Counter(rank_nodes).items() if count % tp)
    if tp > 1 and split:
        notes.append(f"parallel.tp={tp} does not divide the rank count of node(s) {', '.join(split)}: some "
                     "tensor-parallel groups span nodes, and their all-reduces cross the network")
    return RankPlacement(order, tuple(notes))


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))
