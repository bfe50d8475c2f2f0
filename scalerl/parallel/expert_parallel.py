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

`parallelize` applies it under DDP (``parallel.ep`` = ``parallel.dp_replicate``): DDP leaves the expert
parameters out of its averaging (their gradients are already sums over ranks, scaled here), the gradient
norm adds each rank's experts once (`expert_parallel_grad_norm`), and the export gathers them
(`gather_experts`).
"""

from __future__ import annotations

import torch
from torch import nn

from scalerl.models.moe import SparseMoeBlock, moe_blocks
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


def apply_expert_parallel(model: nn.Module, ctx: DistContext, over="dp") -> list[nn.Parameter]:
    """Keep this rank's share of every sparse block's experts (contiguous global indices) and route tokens
    by all-to-all over ``over`` (default the data-parallel ranks); returns the expert parameters kept.

    Their gradients already hold every rank's tokens, so DDP leaves them out (its ignore list) and each is
    scaled by ``1 / ranks`` as it lands: the mean DDP takes of the other gradients."""
    group, size, _ = ctx.group_of(over)
    rank = torch.distributed.get_group_rank(group, ctx.rank) if size > 1 else 0
    for block in moe_blocks(getattr(model, "backbone", model)):
        if block.num_experts % size:
            raise LayoutError(f"expert parallelism over {size} ranks needs num_experts divisible by it, got "
                              f"num_experts={block.num_experts}")
        kept = block.num_experts // size
        first = rank * kept
        block.experts = nn.ModuleDict({str(j): block.experts[j] for j in range(first, first + kept)})
        block.expert_dispatch = ExpertParallelDispatch(ctx, over, first, kept, size)
    names = [n for n, _ in model.named_parameters() if is_expert_parameter(n)]
    model._ddp_params_and_buffers_to_ignore = names  # read by DistributedDataParallel when it wraps the model
    params = [p for n, p in model.named_parameters() if is_expert_parameter(n)]
    for p in params:
        p.register_hook(lambda grad, scale=1.0 / size: grad * scale)
    return params


def uses_expert_parallel(model: nn.Module) -> bool:
    """True when ``model``'s experts are split over the ranks (`apply_expert_parallel` ran on it)."""
    return any(getattr(m, "expert_dispatch", None) is not None for m in model.modules())


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight (``...mlp.experts.{j}.*``; not the shared expert, not the router)."""
    return ".mlp.experts." in name


def expert_parallel_grad_norm(params: list[nn.Parameter], expert_params: list[nn.Parameter], max_norm: float,
                              ctx: DistContext, over="dp") -> torch.Tensor:
    """Clip by the global gradient norm: replicated gradients counted once, each rank's experts added
    (one scalar all-reduce, ``metrics`` traffic). Returns the norm before clipping."""
    experts = {id(p) for p in expert_params}
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())

    def squares(gs) -> torch.Tensor:
        return sum((g.detach().float().pow(2).sum() for g in gs), torch.zeros((), device=grads[0].device))

    replicated = squares(p.grad for p in params if p.grad is not None and id(p) not in experts)
    sharded = squares(p.grad for p in expert_params if p.grad is not None)
    norm = (replicated + ctx.all_reduce(sharded.reshape(1), over=over)[0]).sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm


def gather_experts(model: nn.Module, ctx: DistContext, over="dp") -> dict[str, torch.Tensor]:
    """Every rank's expert weights under their global names (collective: every rank calls it), on CPU;
    empty without expert parallelism. What an export or a full state dict needs from the other ranks."""
    out: dict[str, torch.Tensor] = {}
    for block_name, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock) or block.expert_dispatch is None:
            continue
        dispatch = block.expert_dispatch
        # Local slot by local slot, so every rank gathers the same tensor in the same call.
        for slot, expert in enumerate(block.experts.values()):
            for name, p in expert.named_parameters():
                rows = ctx.all_gather(p.detach().unsqueeze(0).contiguous(), over=over, kind="param")
                for r in range(dispatch.num_ranks):
                    out[f"{block_name}.experts.{r * dispatch.num_local + slot}.{name}"] = rows[r].cpu()
    return out
