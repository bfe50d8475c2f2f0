"""Expert parallelism: each data-parallel rank keeps ``num_experts / dp`` experts of every sparse MoE block,
and tokens travel to the rank that owns their expert and back by all-to-all.

Per block and forward, over the DP group (sizes ``P`` ranks, ``E_l = E / P`` local experts):

1. the local tokens' top-k assignments are sorted by expert, and every rank's count per expert plus its
   real-token count is gathered (one all-gather of ``[1, E + 1]`` int64 per rank): every rank then knows
   what each rank sends to each expert, and the forward's token count that a capacity factor needs;
2. the rows are laid out in ``P`` equal chunks of the largest per-(source, destination) share, chunk ``j``
   holding the rows for rank ``j``'s experts in expert order, and exchanged (all-to-all); under a capacity
   factor their routing weights follow the same way (an all-to-all of ``P x chunk`` fp32);
3. each rank runs its experts on the rows it received (under a capacity factor only each expert's
   `expert_capacity` heaviest, `keep_heaviest`: the ones one process keeps), and the outputs go back the
   same way (all-to-all), zero for a dropped assignment;
4. each token sums its outputs times its routing weights, as without expert parallelism.

Per forward a rank thus counts ``(P-1)/P x (P(E+1) x 8)`` bytes for the gather and ``(P-1)/P x P x chunk x
H x dtype bytes`` for each of the two all-to-alls, and the backward's two all-to-alls the same again (plus
``(P-1)/P x P x chunk x 4`` for the weights under a capacity factor). A capacity factor bounds the experts'
work, not these buffers.

The all-to-alls are differentiable (the backward of an equal-chunk all-to-all is the same all-to-all of the
gradients), so an expert's gradient on its owner holds every rank's tokens. Collectives go through
`DistContext.all_to_all` / ``all_reduce`` and are counted as ``expert`` traffic. Expert tensors keep their
global names (``experts`` becomes a ModuleDict keyed by the global expert index), so a rank's state dict
names exactly the experts it holds.

`parallelize` applies it under DDP or FSDP2. The ``parallel.ep`` ranks that split the experts are
consecutive data-parallel ranks (the expert-parallel group); the ``dp / ep`` ranks at the same place in
each such group hold the same experts (the expert replicas, torchtitan's ``dp_shard_mod_ep``):

- DDP (``parallel.ep`` = ``parallel.dp_replicate``, one replica each): DDP leaves the expert parameters
  out of its averaging, and each expert gradient (already a sum over the ranks' tokens) is scaled by
  ``1 / ep`` as it lands: the mean DDP takes of the others;
- FSDP2 / HSDP (``parallel.ep`` dividing ``dp_replicate x dp_shard``): dense and attention parameters are
  sharded over the data-parallel mesh as without experts; each block's experts are one FSDP unit of their
  own over the expert replicas (`shard_experts`), whose gradients are summed there and divided by ``dp``:
  the same mean over every rank's tokens. (Their all-gathers and reduce-scatters are counted with the
  data-parallel ones, as ``param`` / ``grad`` traffic.)

Either way the gradient norm adds every rank's share of the experts once (`expert_parallel_grad_norm`),
and the export gathers them (`gather_experts`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from scalerl.models.moe import (
    SparseMoeBlock,
    expert_capacity,
    keep_heaviest,
    moe_blocks,
    padded_as_extra_expert,
)
from scalerl.parallel.data_parallel import mixed_precision_policies
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.grad_norm import total_grad_norm
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

    def __init__(self, ctx: DistContext, over, first: int, num_local: int, num_ranks: int, rank: int,
                 replicas: DeviceMesh | None = None):
        self.ctx, self.over = ctx, over
        self.first, self.num_local, self.num_ranks, self.rank = first, num_local, num_ranks, rank
        self.replicas = replicas  # the 1-D mesh of the ranks holding the same experts (FSDP2 shards them there)

    def __call__(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 local_experts: nn.ModuleDict, capacity_factor: float = 0.0,
                 real: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The routed outputs of this rank's tokens, and the assignments this rank's experts dropped
        (`routed_expert_outputs`)."""
        ranks, per_rank, top_k = self.num_ranks, self.num_local, experts.shape[-1]
        num_experts = ranks * per_rank
        real = real if capacity_factor > 0 else None
        assigned = padded_as_extra_expert(experts, real, num_experts)
        local_counts = torch.bincount(assigned, minlength=num_experts + 1)[:num_experts]
        tokens = flat.shape[0] if real is None else real.sum()
        mine = torch.cat([local_counts, torch.as_tensor(tokens, device=flat.device).reshape(1)]).to(torch.int64)
        table = self.ctx.all_gather(mine.unsqueeze(0), over=self.over, kind=KIND)  # [P, E + 1]
        per_dest = table[:, :num_experts].view(ranks, ranks, per_rank)  # [source, destination, local expert]
        # This rank's sorted assignments (padding last, left out), each with its slot in the send buffer:
        # its destination's chunk, then its expert's place in that chunk, then its own place among them.
        order = torch.argsort(assigned, stable=True)[: int(local_counts.sum())]
        rows = order // top_k
        capacity = max(int(per_dest.sum(-1).max()), 1)
        dest = assigned[order] // per_rank
        sent_per_dest = local_counts.view(ranks, per_rank).sum(1)
        chunk_start = torch.cumsum(sent_per_dest, 0) - sent_per_dest
        slot = dest * capacity + torch.arange(len(order), device=flat.device) - chunk_start[dest]
        send = flat.new_zeros(ranks * capacity, flat.shape[-1]).index_add(0, slot, flat.index_select(0, rows))
        recv = _AllToAll.apply(send, self.ctx, self.over)
        row_weights = weights.reshape(-1)[order]
        limit = None
        if capacity_factor > 0:  # the owners choose what their experts keep: they need the weights too
            limit = expert_capacity(int(table[:, num_experts].sum()), top_k, num_experts, capacity_factor)
            sent_weights = torch.zeros(ranks * capacity, dtype=torch.float32, device=flat.device)
            sent_weights = sent_weights.index_copy(0, slot, row_weights.detach().float())
            recv_weights = self.ctx.all_to_all(sent_weights, over=self.over, kind=KIND)
        outputs = torch.zeros_like(recv)
        received = per_dest[:, self.rank]  # [P, E_l]: what each source sends to each of this rank's experts
        starts = (torch.cumsum(received, 1) - received).tolist()
        received = received.tolist()
        dropped = 0
        for e, expert in enumerate(local_experts.values()):  # the rows each source sent to expert e, in rank order
            idx = torch.cat([torch.arange(i * capacity + starts[i][e], i * capacity + starts[i][e] + received[i][e],
                                          device=flat.device) for i in range(ranks)])
            kept = keep_heaviest(recv_weights[idx], limit) if limit is not None else None
            if kept is not None:
                dropped += len(idx) - len(kept)
                idx = idx[kept]
            outputs.index_add_(0, idx, expert(recv.index_select(0, idx)))
        back = _AllToAll.apply(outputs, self.ctx, self.over)
        weighted = back.index_select(0, slot) * row_weights.unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, rows, weighted), dropped


def apply_expert_parallel(model: nn.Module, ctx: DistContext, ep: int | None = None,
                          sharded: bool = False) -> list[nn.Parameter]:
    """Keep this rank's share of every sparse block's experts (contiguous global indices) and route tokens
    by all-to-all over its expert-parallel group: ``ep`` consecutive data-parallel ranks (default
    ``parallel.ep``, or all of them when that is 1). Returns the expert parameters kept.

    Not ``sharded`` (DDP, ``ep`` = every data-parallel rank): their gradients already hold every rank's
    tokens, so DDP leaves them out (its ignore list) and each is scaled by ``1 / ep`` as it lands: the mean
    DDP takes of the other gradients. ``sharded`` (FSDP2 next): `shard_experts` lays them out."""
    dp_size = ctx.dims.dp if ctx.dp_group is not None else 1
    ep = ep or (ctx.dims.ep if ctx.dims.ep > 1 else dp_size)
    if dp_size % ep or (not sharded and ep != dp_size):
        raise LayoutError(f"parallel.ep={ep} must {'divide' if sharded else 'equal'} the data-parallel ranks "
                          f"({dp_size}){'' if sharded else ' under DDP (parallel.dp_shard=1)'}")
    over, rank, replicas = _expert_groups(ctx, ep, dp_size, sharded)
    for block in moe_blocks(getattr(model, "backbone", model)):
        if block.num_experts % ep:
            raise LayoutError(f"expert parallelism over {ep} ranks needs num_experts divisible by it, got "
                              f"num_experts={block.num_experts}")
        kept = block.num_experts // ep
        first = rank * kept
        block.experts = nn.ModuleDict({str(j): block.experts[j] for j in range(first, first + kept)})
        block.expert_dispatch = ExpertParallelDispatch(ctx, over, first, kept, ep, rank, replicas)
    params = [p for n, p in model.named_parameters() if is_expert_parameter(n)]
    if not sharded:
        model._ddp_params_and_buffers_to_ignore = [n for n, _ in model.named_parameters() if is_expert_parameter(n)]
        for p in params:  # (DDP reads the ignore list when it wraps the model)
            p.register_hook(lambda grad, scale=1.0 / ep: grad * scale)
    return params


def _expert_groups(ctx: DistContext, ep: int, dp_size: int, sharded: bool):
    """(the expert-parallel group, this rank's place in it, the mesh of its expert replicas or None).

    Every data-parallel rank creates every group (``new_group`` is collective); with ``ep`` = all of them
    the group is ``"dp"`` itself (counted under that dimension)."""
    if dp_size == 1:
        return "dp", 0, None
    dp_ranks = dist.get_process_group_ranks(ctx.dp_group)
    me = dp_ranks.index(dist.get_rank())
    over = "dp"
    if ep < dp_size:
        for start in range(0, dp_size, ep):
            group = dist.new_group(dp_ranks[start:start + ep], sort_ranks=False)
            if start <= me < start + ep:
                over = group
    replicas = None
    if sharded:
        for slot in range(ep):
            row = dp_ranks[slot::ep]
            group = dist.new_group(row, sort_ranks=False)
            if me % ep == slot:
                replicas = DeviceMesh.from_group(group, ctx.device.type, mesh=row, mesh_dim_names=("ep_replicate",))
    return over, me % ep, replicas


def shard_experts(model: nn.Module, param_dtype: torch.dtype | None = None,
                  reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> None:
    """Each sparse block's local experts as one FSDP2 unit over their replicas (before the decoder layers
    are sharded: the layers' units then leave these parameters out). Their gradients are summed over the
    replicas and divided by every data-parallel rank (``ep x replicas``): an expert's gradient on its
    owner already sums its expert-parallel group's tokens, so that is the mean over all ranks' tokens the
    dense gradients get. Summed, not averaged, on the wire (gloo has no pre-multiplied sum)."""
    layers, _ = mixed_precision_policies(param_dtype, reduce_dtype)
    for block in moe_blocks(getattr(model, "backbone", model)):
        dispatch = block.expert_dispatch
        if dispatch is None or dispatch.replicas is None:
            raise LayoutError("shard_experts needs apply_expert_parallel(..., sharded=True) first")
        experts = list(block.experts.values())  # one unit: unsharded at the first expert's forward
        fully_shard(experts, mesh=dispatch.replicas, reshard_after_forward=reshard_after_forward, **layers)
        experts[0].set_gradient_divide_factor(float(dispatch.num_ranks * dispatch.replicas.size()))  # the unit's
        if dispatch.replicas.size() > 1:  # (a unit of one rank divides once without it; with it, twice)
            experts[0].set_force_sum_reduction_for_comms(True)


def uses_expert_parallel(model: nn.Module) -> bool:
    """True when ``model``'s experts are split over the ranks (`apply_expert_parallel` ran on it)."""
    return any(getattr(m, "expert_dispatch", None) is not None for m in model.modules())


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight (``...mlp.experts.{j}.*``; not the shared expert, not the router)."""
    return ".mlp.experts." in name


def expert_parallel_grad_norm(params: list[nn.Parameter], expert_params: list[nn.Parameter], max_norm: float,
                              ctx: DistContext, over="dp") -> torch.Tensor:
    """Clip by the global gradient norm: the other gradients' as `total_grad_norm` takes it (replicated
    ones counted once, FSDP shards summed over their mesh), plus the experts' squares summed over the
    data-parallel ranks (each rank holds its own share of them: experts split by expert parallelism, and
    under FSDP2 each split again over its replicas). Returns the norm before clipping."""
    experts = {id(p) for p in expert_params}
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in expert_params) if g is not None]
    sharded = sum((g.detach().float().pow(2).sum() for g in local), torch.zeros((), device=ctx.device))
    others = [p.grad for p in params if p.grad is not None and id(p) not in experts]
    replicated = total_grad_norm(others, counter=ctx.comm).to(sharded.device).pow(2) if others else 0.0
    norm = (replicated + ctx.all_reduce(sharded.reshape(1), over=over)[0]).sqrt()
    if max_norm > 0:
        scale = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
        for g in grads:
            g.mul_(scale)
    return norm


def gather_experts(model: nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """Every rank's expert weights under their global names (collective: every rank calls it), on CPU;
    empty without expert parallelism. What an export or a full state dict needs from the other ranks."""
    out: dict[str, torch.Tensor] = {}
    for block_name, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock) or block.expert_dispatch is None:
            continue
        dispatch = block.expert_dispatch
        # Local slot by local slot, so every rank gathers the same tensor in the same call: whole over its
        # replicas first (FSDP2's shards), then over the expert-parallel group.
        for slot, expert in enumerate(block.experts.values()):
            for name, p in expert.named_parameters():
                whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
                rows = ctx.all_gather(whole.unsqueeze(0).contiguous(), over=dispatch.over, kind="param")
                for r in range(dispatch.num_ranks):
                    out[f"{block_name}.experts.{r * dispatch.num_local + slot}.{name}"] = rows[r].cpu()
    return out
