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

from scalerl.comm.counting.counted_collectives import CountedCollectives

PIPELINE_CHUNK_BYTES = 4 * 2**20  # chunks of a dense hierarchical all-reduce (>= 4 MiB each)
MAX_PIPELINE_CHUNKS = 16
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


def pipeline_chunks(nbytes: int) -> int:
    """Chunks a dense hierarchical all-reduce of `nbytes` is cut into (see `hierarchical_all_reduce`)."""
    return max(1, min(MAX_PIPELINE_CHUNKS, nbytes // PIPELINE_CHUNK_BYTES))


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierarchicalGroups,
                            collectives: CountedCollectives | None = None,
                            inter_reduce: InterReduce | None = None,
                            inter_dtype: torch.dtype | None = None, chunks: int | None = None) -> torch.Tensor:
    """SUM of a flat `tensor` over all ranks, in place, through the node hierarchy. Sizes that do not
    divide by the local size are zero-padded.

    Dense (the default, or the inter-node step cast to `inter_dtype`, e.g. bf16): the tensor is cut into
    `chunks` (default: one per PIPELINE_CHUNK_BYTES, at most MAX_PIPELINE_CHUNKS) whose three phases are
    pipelined with async collectives, so the inter-node link carries chunk i while the node reduces
    chunk i+1 and gathers chunk i-1. `inter_reduce` instead replaces the inter-node all-reduce of this
    rank's whole shard (`shard_bounds`; it holds its node's sum) with, e.g., a compressed exchange; that
    path runs its phases one after the other."""
    collectives = collectives or CountedCollectives()
    flat = tensor.view(-1)
    numel, local = flat.numel(), groups.local_size
    if inter_reduce is not None:
        if inter_dtype is not None:
            raise ValueError("give inter_reduce or inter_dtype, not both")
        chunks = 1
    elif chunks is None:
        chunks = pipeline_chunks(numel * flat.element_size())
    padded = -(-numel // (local * chunks)) * local * chunks
    work = F.pad(flat, (0, padded - numel)) if padded != numel else flat
    pieces = work.view(chunks, padded // chunks)  # chunk c: local shards of padded / chunks / local each
    shards = torch.empty(chunks, padded // chunks // local, dtype=flat.dtype, device=flat.device)
    reduced = [collectives.reduce_scatter(shards[c], pieces[c], groups.intra, "intra", async_op=True)
               if local > 1 else shards[c].copy_(pieces[c]) for c in range(chunks)]
    crossed = []
    for c in range(chunks):
        if local > 1:
            reduced[c].wait()
        if groups.nodes == 1:
            crossed.append((None, shards[c]))
        elif inter_reduce is not None:
            shards[c] = inter_reduce(shards[c])
            crossed.append((None, shards[c]))
        else:
            buf = shards[c] if inter_dtype is None else shards[c].to(inter_dtype)
            crossed.append((collectives.all_reduce(buf, groups.inter, "inter", async_op=True), buf))
    gathered = []
    for c, (handle, buf) in enumerate(crossed):
        if handle is not None:
            handle.wait()
        if buf.data_ptr() != shards[c].data_ptr():
            shards[c].copy_(buf)
        if local > 1:
            gathered.append(collectives.all_gather(pieces[c], shards[c], groups.intra, "intra", async_op=True))
        else:
            pieces[c].copy_(shards[c])
    for handle in gathered:
        handle.wait()
    if work.data_ptr() != flat.data_ptr():
        flat.copy_(work[:numel])
    return tensor
