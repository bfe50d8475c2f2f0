"""Hierarchical all-reduce: intra-node reduce-scatter -> inter-node all-reduce of each shard among the
ranks with the same local rank (all shards at once, one per local rank) -> intra-node all-gather.

Why: a flat ring over grouped nodes sends 2(n-1)/n x S over each node's link; the hierarchy sends
2(N-1)/N x S (N nodes, n ranks), moving the rest of the work onto the fast intra-node links.

Groups come from the node layout (ranks of a node contiguous). Creating them is collective: every rank of
the job calls `HierarchicalGroups(...)` with the same layout, in the same order (`new_group`, since
`split_group` does not work on gloo). The same code runs on NCCL (CUDA tensors) but has only been run
on gloo here.

    groups = HierarchicalGroups(NodeLayout.blocks(world_size=4, ranks_per_node=2))
    hierarchical_all_reduce(tensor, groups)      # in place, SUM over all ranks
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scalerl.comm.counted_collectives import CountedCollectives

# inter_reduce(shard) -> the shard summed over the inter-node group (dense all-reduce by default; a
# compressor replaces it to compress only what crosses the slow link).
InterReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NodeLayout:
    """The node of each rank of a process group, indexed by group rank."""

    node_of_rank: tuple[int, ...]

    @classmethod
    def blocks(cls, world_size: int, ranks_per_node: int) -> NodeLayout:
        """Contiguous nodes of `ranks_per_node` ranks: 0-1 / 2-3 for (4, 2)."""
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide world_size={world_size}")
        return cls(tuple(r // ranks_per_node for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of_rank))

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def problem(self) -> str | None:
        """Why a hierarchical all-reduce cannot run on this layout; None when it can."""
        sizes = {node: self.node_of_rank.count(node) for node in set(self.node_of_rank)}
        if len(set(sizes.values())) > 1:
            return f"nodes hold different numbers of ranks ({dict(sorted(sizes.items()))})"
        if self.node_of_rank != NodeLayout.blocks(self.world_size, self.ranks_per_node).node_of_rank:
            return f"ranks of a node are not contiguous in rank order (node of each rank: {list(self.node_of_rank)})"
        return None

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.ranks_per_node} rank(s)"


def gather_node_layout(group=None, device: torch.device | None = None) -> NodeLayout:
    """Every rank's node number (the launcher's GROUP_RANK, which `apply_rank_env` sets for torchrun,
    Slurm, MPI and Ray alike) gathered over `group`. A collective: call it on every rank of `group`.
    The launcher's number rather than the hostname: network-namespace nodes share one hostname."""
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    device = device or (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                        else torch.device("cpu"))
    mine = torch.tensor([node], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return NodeLayout(tuple(int(x.item()) for x in gathered))


class HierarchicalGroups:
    """This rank's intra-node group (its node's ranks) and inter-node group (same local rank on every
    node), built from `layout` over `group`'s ranks. Collective: every rank of the job calls it."""

    def __init__(self, layout: NodeLayout, group=None):
        problem = layout.problem()
        if problem is not None:
            raise ValueError(f"hierarchical all-reduce needs equal, contiguous nodes: {problem}")
        group = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)  # global ranks, in group-rank order
        if len(ranks) != layout.world_size:
            raise ValueError(f"node layout covers {layout.world_size} ranks but the group has {len(ranks)}")
        if len(ranks) != dist.get_world_size():
            # new_group must be called by every rank of the job; a subgroup's outsiders would not.
            raise ValueError("hierarchical all-reduce runs over the whole job's ranks (DDP-only layouts); "
                             f"this group has {len(ranks)} of {dist.get_world_size()}")
        self.layout, self.group = layout, group
        nodes, per_node = layout.nodes, layout.ranks_per_node
        me = dist.get_group_rank(group, dist.get_rank())
        self.node, self.local_rank = me // per_node, me % per_node
        self.intra = self.inter = None
        for node in range(nodes):  # identical order on every rank
            g = dist.new_group([ranks[node * per_node + j] for j in range(per_node)])
            if node == self.node:
                self.intra = g
        for local in range(per_node):
            g = dist.new_group([ranks[node * per_node + local] for node in range(nodes)])
            if local == self.local_rank:
                self.inter = g

    @property
    def local_size(self) -> int:
        return self.layout.ranks_per_node

    @property
    def nodes(self) -> int:
        return self.layout.nodes

    def shard_bounds(self, numel: int) -> tuple[int, int]:
        """[start, end) of this rank's shard of a `numel` tensor padded to a multiple of the local size;
        `end` may pass `numel` (padding)."""
        shard = -(-numel // self.local_size)
        return self.local_rank * shard, (self.local_rank + 1) * shard


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierarchicalGroups,
                            collectives: CountedCollectives | None = None,
                            inter_reduce: InterReduce | None = None) -> torch.Tensor:
    """SUM of a flat `tensor` over all ranks, in place, through the node hierarchy. Sizes that do not
    divide by the local size are zero-padded. `inter_reduce` replaces the inter-node dense all-reduce
    of this rank's shard (which holds its node's sum) with, e.g., a compressed exchange."""
    collectives = collectives or CountedCollectives()
    flat = tensor.view(-1)
    numel, local = flat.numel(), groups.local_size
    padded = -(-numel // local) * local
    work = F.pad(flat, (0, padded - numel)) if padded != numel else flat
    shard = torch.empty(padded // local, dtype=flat.dtype, device=flat.device)
    if local > 1:
        collectives.reduce_scatter(shard, work, groups.intra, "intra")
    else:
        shard.copy_(work)
    if groups.nodes > 1:
        if inter_reduce is None:
            collectives.all_reduce(shard, groups.inter, "inter")
        else:
            shard = inter_reduce(shard)
    if local > 1:
        collectives.all_gather(work, shard, groups.intra, "intra")  # `work` is `flat` unless padded
        if work.data_ptr() != flat.data_ptr():
            flat.copy_(work[:numel])
    else:
        flat.copy_(shard[:numel])
    return tensor
