"""Expert parallelism: each data-parallel rank keeps ``num_experts / dp`` experts of every sparse MoE block,
and tokens travel to the rank that owns their expert and back by all-to-all.

Per block and forward, over the DP group (sizes ``P`` ranks, ``E_l = E / P`` local experts):

1. the local tokens' top-k assignments are sorted by expert; how many go to each expert is exchanged
   (an all-to-all of ``[P, E_l]`` counts) and the largest per-rank share is agreed (an all-reduce max);
2. the assigned rows are laid out in ``P`` equal chunks of that capacity, chunk ``j`` holding the rows for
   rank ``j``'s experts in expert order, and exchanged (all-to-all);
3. each rank runs its experts on the rows it received, and the outputs go back the same way (all-to-all);
4. each token sums its ``k`` outputs times its routing weights, as without expert parallelism.

The all-to-alls are differentiable (the backward of an equal-chunk all-to-all is the same all-to-all of the
gradients), so an expert's gradient on its owner holds every rank's tokens. Collectives go through
`DistContext.all_to_all` / ``all_reduce`` and are counted as ``expert`` traffic. Expert tensors keep their
global names (``experts`` becomes a ModuleDict keyed by the global expert index), so a rank's state dict
names exactly the experts it holds.

Not wired into `parallelize` yet: data parallelism would have to leave the expert parameters out of its
gradient averaging (their gradients are already the sum over ranks) and checkpoints / exports would have
to gather them. This module is the dispatch, tested against one process (tests/models/test_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from scalerl.models.moe import moe_blocks
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.mesh import LayoutError

KIND = "expert"


class _AllToAll(torch.autograd.Function):
    """Equal-chunk all-to-all whose backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: DistContext, over) -> torch.Tensor:
        fctx.ctx, fctx.over = ctx, over
        return ctx.all_to_all(x, over=over, kind=KIND)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        return fctx.ctx.all_to_all(grad.contiguous(), over=fctx.over, kind=KIND), None, None


class ExpertParallelDispatch:
    """``routed_expert_outputs`` for a block whose experts are spread over the ranks of ``over``."""

    def __init__(self, ctx: DistContext, over, first: int, num_local: int, num_ranks: int):
        self.ctx, self.over = ctx, over
        self.first, self.num_local, self.num_ranks = first, num_local, num_ranks

    def __call__(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 local_experts: nn.ModuleDict) -> torch.Tensor:
        ranks, per_rank, top_k = self.num_ranks, self.num_local, experts.shape[-1]
        assigned = experts.reshape(-1)
        order = torch.argsort(assigned, stable=True)
        rows = order // top_k
        counts = torch.bincount(assigned, minlength=ranks * per_rank).view(ranks, per_rank)
        # [P, E_l]: row i = what rank i sends to each of this rank's experts
        received = self.ctx.all_to_all(counts.clone(), over=self.over, kind=KIND)
        sent_per_rank = counts.sum(1)
        capacity = self.ctx.all_reduce(sent_per_rank.max().reshape(1).clone(), op="max", over=self.over, kind=KIND)
        capacity = max(int(capacity), 1)
        # Slot of each sorted assignment in the send buffer: its rank's chunk, then its place in that chunk.
        dest = assigned[order] // per_rank
        chunk_start = torch.cumsum(sent_per_rank, 0) - sent_per_rank
        slot = dest * capacity + torch.arange(len(order), device=flat.device) - chunk_start[dest]
        send = flat.new_zeros(ranks * capacity, flat.shape[-1]).index_add(0, slot, flat.index_select(0, rows))
        recv = _AllToAll.apply(send, self.ctx, self.over)
        outputs = torch.zeros_like(recv)
        starts = (torch.cumsum(received, 1) - received).tolist()
        received = received.tolist()
        for e, expert in enumerate(local_experts.values()):  # the rows each source sent to expert e
            idx = torch.cat([torch.arange(i * capacity + starts[i][e], i * capacity + starts[i][e] + received[i][e],
                                          device=flat.device) for i in range(ranks)])
            outputs.index_add_(0, idx, expert(recv.index_select(0, idx)))
        back = _AllToAll.apply(outputs, self.ctx, self.over)
        mine = back.index_select(0, slot) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, rows, mine)


def apply_expert_parallel(model: nn.Module, ctx: DistContext, over="dp") -> int:
    """Keep this rank's share of every sparse block's experts (contiguous global indices) and route tokens
    by all-to-all over ``over`` (default the data-parallel ranks); returns the experts kept per block."""
    group, size, _ = ctx.group_of(over)
    rank = torch.distributed.get_group_rank(group, ctx.rank) if size > 1 else 0
    kept = 0
    for block in moe_blocks(getattr(model, "backbone", model)):
        if block.num_experts % size:
            raise LayoutError(f"expert parallelism over {size} ranks needs num_experts divisible by it, got "
                              f"num_experts={block.num_experts}")
        kept = block.num_experts // size
        first = rank * kept
        block.experts = nn.ModuleDict({str(j): block.experts[j] for j in range(first, first + kept)})
        block.expert_dispatch = ExpertParallelDispatch(ctx, over, first, kept, size)
    return kept
