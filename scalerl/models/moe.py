"""Sparse mixture-of-experts blocks of Qwen2-MoE and Qwen3-MoE: a top-k router, SwiGLU experts, Qwen2-MoE's
sigmoid-gated shared expert, the load-balancing auxiliary loss and the router's load metrics.

Parameter names are those of the published checkpoints (``mlp.gate.weight``, ``mlp.experts.{j}.gate_proj
.weight``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``), so loading and saving need no
renaming; transformers 5 fuses the experts in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
``mlp.experts.down_proj`` ``[E, H, I]``) and a checkpoint written that way is split at load time
(`split_fused_experts`).

Tokens are grouped by expert (one sort of the token -> expert assignments, then one gather, SwiGLU and
scatter-add per expert): a loop over experts, never over tokens. Every expert runs, with zero rows when it
got no token, so all parameters take part in every backward (DDP needs that without
``find_unused_parameters``).

A capacity factor (``model.moe_capacity_factor``, `set_capacity_factor`) bounds what each expert takes in a
training forward: at most ``expert_capacity`` = ``ceil(factor * tokens * top_k / num_experts)`` assignments,
``tokens`` the forward's real (unpadded) tokens over all expert-parallel ranks (Switch/GShard's definition).
An expert over it keeps its heaviest assignments by routing weight (Megatron's default ``probs`` drop
policy), those tied at the boundary all dropped (`keep_heaviest`), so which ones drop does not depend on the
order of the rows (a shuffled mini-batch, or rows split over expert-parallel ranks, drop what one process does).
A dropped assignment contributes zero and the token keeps its residual (and its other experts). Padding
takes no capacity and gets no expert output once a factor is set.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class ExpertMLP(nn.Module):
    """One expert (or the shared expert): ``down(silu(gate(x)) * up(x))`` of width ``intermediate``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Linear):
    """Softmax over ``num_experts`` logits in fp32, the ``top_k`` largest kept, renormalised to sum to one
    when ``norm_topk_prob`` (Qwen3-MoE's published configs), else left as they are (Qwen1.5/2-MoE).
    A bias-free Linear ``[E, H]``, so the decoder's initialisation and the tensor name ``mlp.gate.weight``
    come with it."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__(hidden, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[N, H]`` -> (logits ``[N, E]``, weights ``[N, k]`` in ``x``'s dtype, expert ids ``[N, k]``).

        ``replay`` ``[N, k]`` (routing replay, `scalerl.models.routing_replay`): recorded expert ids used in
        place of the top-k, each row whose ids are all >= 0 (a row with -1 keeps the router's own choice);
        their weights are the current probabilities at those ids (renormalised alike), so the router still
        gets its gradient."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if replay is not None:
            replay = replay.to(device=experts.device, dtype=torch.long)
            experts = torch.where((replay >= 0).all(-1, keepdim=True), replay, experts)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


class SparseMoeBlock(nn.Module):
    """Routed experts plus, for Qwen2-MoE, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

    The router logits of the latest forward stay on the block (``last_router_logits``, ``[N, E]`` with
    their graph) for the auxiliary loss and the load metrics, which the trainer reads right after the
    forward; the next forward replaces them."""

    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.gate = TopKRouter(hidden, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = nn.ModuleList(ExpertMLP(hidden, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(hidden, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.last_router_logits: torch.Tensor | None = None
        # Expert parallelism (scalerl.parallel.expert_parallel) routes over ranks in place of the local loop.
        self.expert_dispatch = None
        self.capacity_factor = 0.0  # 0 = every assignment runs; applies to training forwards only
        self.token_mask: torch.Tensor | None = None  # [N] bool of the forward's real rows (`set_capacity_factor`)
        # (assignments dropped, assignments of real tokens) of the latest capacity-limited forward, on this rank
        self.last_drop_counts: torch.Tensor | None = None
        # Routing replay: recorded expert ids [N, k] of the next forward's flattened tokens (-1: none), set
        # by `scalerl.models.routing_replay.replaying_routes`; None routes by the router's own top-k.
        self.replay_experts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        replay = self.replay_experts
        if replay is not None and replay.shape[0] != flat.shape[0]:
            raise ValueError(f"routing replay: {replay.shape[0]} recorded routes for a forward of {flat.shape[0]} "
                             "tokens")
        logits, weights, experts = self.gate(flat) if replay is None else self.gate(flat, replay)
        self.last_router_logits = logits
        factor = self.capacity_factor if self.training else 0.0
        real = None
        if factor > 0 and self.token_mask is not None and self.token_mask.numel() == flat.shape[0]:
            real = self.token_mask.to(flat.device)
        out, dropped = (self.expert_dispatch or routed_expert_outputs)(flat, weights, experts, self.experts,
                                                                       factor, real)
        if factor > 0:
            tokens = flat.shape[0] if real is None else int(real.sum())
            self.last_drop_counts = torch.tensor([float(dropped), float(tokens * self.top_k)])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Switch/GShard's expert capacity: ``ceil(factor * tokens * top_k / num_experts)`` assignments."""
    return math.ceil(factor * tokens * top_k / num_experts)


def padded_as_extra_expert(experts: torch.Tensor, real: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """The ``N * k`` assignments flattened, those of padding rows (``real`` False) sent to the id
    ``num_experts``: a bin no expert reads, sorted after every real one."""
    assigned = experts.reshape(-1)
    if real is None:
        return assigned
    return assigned.masked_fill(~real.bool().repeat_interleave(experts.shape[-1]), num_experts)


def routed_expert_outputs(flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          expert_modules: nn.ModuleList, capacity_factor: float = 0.0,
                          real: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """``sum_k weights[n, k] * expert_{experts[n, k]}(flat[n])`` by grouping the ``N * k`` assignments by
    expert: one stable sort (so each expert's rows stay in token order), then per expert one gather of its
    rows and one scatter-add of its outputs. With ``capacity_factor`` each expert keeps the
    `expert_capacity` assignments of real rows (``real`` ``[N]``; None = every row) with the largest
    weights (`keep_heaviest`: at most that many) and drops the rest. Returns the outputs and the number of assignments dropped."""
    top_k, num_experts = experts.shape[-1], len(expert_modules)
    assigned = padded_as_extra_expert(experts, real if capacity_factor > 0 else None, num_experts)
    order = torch.argsort(assigned, stable=True)
    counts = torch.bincount(assigned, minlength=num_experts + 1).tolist()  # one host sync per layer
    rows = (order // top_k).split(counts)
    row_weights = weights.reshape(-1)[order].split(counts)
    limit = len(order)
    if capacity_factor > 0:
        tokens = flat.shape[0] if real is None else int(real.sum())
        limit = expert_capacity(tokens, top_k, num_experts, capacity_factor)
    out, dropped = torch.zeros_like(flat), 0
    for expert, idx, w in zip(expert_modules, rows, row_weights):  # the padding bin (last) is left out
        kept = keep_heaviest(w, limit)
        if kept is not None:
            dropped += len(idx) - len(kept)
            idx, w = idx[kept], w[kept]
        # (under autocast the experts compute in bf16 while the residual stream stays fp32: add in ``out``'s dtype)
        out.index_add_(0, idx, (expert(flat.index_select(0, idx)) * w.unsqueeze(-1)).to(out.dtype))
    return out, dropped


def keep_heaviest(weights: torch.Tensor, limit: int) -> torch.Tensor | None:
    """Which of one expert's assignments (routing ``weights``) its capacity ``limit`` keeps: those heavier
    than the ``limit + 1``-th heaviest, so at most ``limit``, and assignments tied at the boundary all drop
    (equal tokens in equal contexts tie exactly, e.g. the prompt a GRPO group's rows share: keeping some of
    them would depend on the order of the rows). None when all fit."""
    if len(weights) <= limit:
        return None
    w = weights.detach().float()
    boundary = torch.topk(w, limit + 1).values[-1]
    return torch.nonzero(w > boundary).squeeze(-1)


def set_capacity_factor(model: nn.Module, factor: float | None) -> None:
    """``model.moe_capacity_factor`` on every sparse block of ``model`` (0 / None: no limit). A factor on a
    model without scalerl's MoE blocks is a ValueError. The blocks learn which rows are padding from the
    model's ``attention_mask`` (a forward pre-hook), so padding takes no capacity."""
    if not factor:
        return
    backbone = getattr(model, "backbone", model)
    blocks = moe_blocks(backbone)
    if not blocks:
        raise ValueError(f"model.moe_capacity_factor={factor} applies to MoE models (qwen2_moe / qwen3_moe with "
                         "scalerl's decoder); this model has no sparse MoE block")
    for block in blocks:
        block.capacity_factor = float(factor)

    def mark_real_rows(module, args, kwargs):
        input_ids = args[0] if args else kwargs.get("input_ids")
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        rows = None
        if mask is not None and input_ids is not None:  # a mask that also covers cached keys: this forward's part
            rows = (mask[:, mask.shape[1] - input_ids.shape[1]:] != 0).reshape(-1)
        for block in moe_blocks(module):  # the hooked module's own blocks: a deep copy (a critic) keeps the hook
            block.token_mask = rows

    if not getattr(backbone, "_marks_real_rows", False):
        backbone.register_forward_pre_hook(mark_real_rows, with_kwargs=True)
        backbone._marks_real_rows = True


def is_sparse_layer(cfg, layer_idx: int) -> bool:
    """Transformers' rule: sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer."""
    return (bool(cfg.num_experts) and layer_idx not in cfg.mlp_only_layers
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The sparse blocks of a model (or of a value model's backbone), in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers computes it (``load_balancing_loss_func``):
    ``E * sum_e f_e * P_e``, with ``f_e`` the share of top-k assignments to expert ``e`` and ``P_e`` its mean
    router probability, both over all layers' real tokens (``token_mask`` ``[B, T]`` flattened like the
    logits' rows; None = every row). Only ``P_e`` carries a gradient."""
    device = router_logits[0].device
    mask = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        row_weight = torch.ones(probs.shape[0], device=device) if mask is None else mask
        assignments = assignments.scatter_add(0, chosen.reshape(-1), row_weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * row_weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + row_weight.sum()
    return num_experts * torch.sum((assignments / rows) * (prob_sum / rows))


def expert_token_counts(router_logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Real tokens routed to each expert ``[E]`` (float) from one layer's logits."""
    chosen = torch.topk(router_logits.detach(), top_k, dim=-1).indices
    weight = torch.ones(chosen.shape[0], device=chosen.device) if token_mask is None \
        else token_mask.reshape(-1).to(device=chosen.device, dtype=torch.float32)
    counts = torch.zeros(router_logits.shape[-1], device=chosen.device)
    return counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))


@dataclass
class RouterAuxLoss:
    """The trainer's side of the MoE blocks: after each training forward, ``coef * aux`` to add to the loss
    (transformers adds ``router_aux_loss_coef * aux_loss`` when ``output_router_logits``), and the step's
    metrics: ``moe/aux_loss`` (mean over forwards) and ``moe/expert_load_imbalance`` (the most loaded
    expert's tokens over the mean per expert, in the worst layer, counted over the step's real tokens,
    before any capacity drop); under a capacity factor also ``moe/dropped_tokens`` (token-to-expert
    assignments dropped in the step, all sparse layers, micro-batches and ranks: a token routed to ``k``
    experts counts up to ``k``) and ``moe/dropped_token_fraction`` (over all assignments of real tokens)."""

    blocks: list[SparseMoeBlock]
    coef: float
    _aux: list[torch.Tensor] = field(default_factory=list)
    _counts: torch.Tensor | None = None
    _drops: torch.Tensor | None = None  # (dropped, assigned) summed over the step's forwards and layers

    @classmethod
    def of(cls, model: nn.Module) -> RouterAuxLoss | None:
        """None for a dense model; the coefficient is 0 unless its config enables the loss."""
        model = getattr(model, "backbone", model)
        blocks = moe_blocks(model)
        if not blocks:
            return None
        cfg = model.config
        return cls(blocks, cfg.router_aux_loss_coef if cfg.output_router_logits else 0.0)

    def loss_term(self, token_mask: torch.Tensor | None, num_forwards: int) -> torch.Tensor:
        """``coef * aux / num_forwards`` for the forward just run (micro-batches average their aux), or a
        detached zero when the loss is off; records the metrics either way."""
        logits = [b.last_router_logits for b in self.blocks]
        if token_mask is not None:  # a mask that also covers cached keys: keep the forward's positions
            token_mask = token_mask[:, token_mask.shape[1] - logits[0].shape[0] // token_mask.shape[0]:]
        block = self.blocks[0]
        with torch.set_grad_enabled(self.coef > 0 and torch.is_grad_enabled()):
            aux = load_balancing_loss(logits, block.num_experts, block.top_k, token_mask)
        counts = torch.stack([expert_token_counts(x, block.top_k, token_mask) for x in logits])
        self._counts = counts if self._counts is None else self._counts + counts
        drops = [b.last_drop_counts for b in self.blocks if b.last_drop_counts is not None]
        if drops:
            drops = torch.stack(drops).sum(0).to(counts.device)
            self._drops = drops if self._drops is None else self._drops + drops
        for b in self.blocks:
            b.last_drop_counts = None
        self._aux.append(aux.detach())
        return aux * (self.coef / num_forwards) if self.coef > 0 else aux.detach() * 0.0

    def metrics(self, all_reduce=None) -> dict[str, float]:
        """The metrics since the last call; ``all_reduce(tensor)`` (a sum over data-parallel ranks) makes
        them the whole step's rather than this rank's."""
        if self._counts is None:
            return {}
        # (a capacity factor is set on every rank or on none: the packed length agrees across ranks)
        drops = self._drops if self._drops is not None else torch.zeros(0, device=self._counts.device)
        packed = torch.cat([torch.stack(self._aux).sum().reshape(1), torch.tensor([float(len(self._aux))],
                            device=self._counts.device), drops, self._counts.reshape(-1)])
        if all_reduce is not None:
            packed = all_reduce(packed)
        counts = packed[2 + len(drops):].reshape(self._counts.shape)
        self._aux, self._counts, self._drops = [], None, None
        imbalance = counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)
        out = {"moe/aux_loss": float(packed[0] / packed[1].clamp(min=1)),
               "moe/expert_load_imbalance": float(imbalance.max())}
        if len(drops):
            out["moe/dropped_tokens"] = float(packed[2])
            out["moe/dropped_token_fraction"] = float(packed[2] / packed[3].clamp(min=1))
        return out


_FUSED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def is_fused_experts_name(name: str) -> bool:
    """``layers.{i}.mlp.experts.gate_up_proj`` / ``.down_proj``: transformers 5's in-memory expert layout."""
    return _FUSED_EXPERTS.match(name) is not None


_EXPERT_WEIGHT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def check_fused_experts_shape(name: str, shape: tuple[int, ...], cfg) -> None:
    """A fused expert tensor's ``shape`` against ``cfg``: a ValueError naming the tensor and the fields."""
    kind = _FUSED_EXPERTS.match(name).group(2)
    e, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    want = (e, 2 * inter, hidden) if kind == "gate_up_proj" else (e, hidden, inter)
    if tuple(shape) != want:
        raise ValueError(f"tensor model.{name} has shape {tuple(shape)}, but config.json implies {want} "
                         f"(num_experts={e}, moe_intermediate_size={inter}, hidden_size={hidden})")


def expert_index(name: str) -> int | None:
    """The global expert of a per-expert weight name (``layers.{i}.mlp.experts.{j}.*_proj.weight``), else None."""
    match = _EXPERT_WEIGHT.match(name)
    return int(match.group(2)) if match else None


def fused_expert_block(name: str, cfg) -> tuple[str, int, int] | None:
    """Where the per-expert weight ``name`` lies in the fused layout: (the fused tensor's name, the expert
    ``j``, its first row there), or None for any other name. ``gate_proj`` is rows ``[0, I)`` of
    ``gate_up_proj[j]``, ``up_proj`` rows ``[I, 2I)``, ``down_proj`` all of ``down_proj[j]``: what a reader
    of slices needs (`scalerl.models.sharded_loading`), where `split_fused_experts` splits a whole tensor."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    prefix, j, kind = match.groups()
    if kind == "down_proj":
        return f"{prefix}.down_proj", int(j), 0
    return f"{prefix}.gate_up_proj", int(j), 0 if kind == "gate_proj" else cfg.moe_intermediate_size


def split_fused_experts(name: str, tensor: torch.Tensor, cfg) -> dict[str, torch.Tensor]:
    """A fused expert tensor as the per-expert weights it holds; a shape that does not fit ``cfg`` is a
    ValueError naming the tensor and the config fields."""
    prefix, kind = _FUSED_EXPERTS.match(name).groups()
    check_fused_experts_shape(name, tuple(tensor.shape), cfg)
    e = cfg.num_experts
    if kind == "down_proj":
        return {f"{prefix}.{j}.down_proj.weight": tensor[j] for j in range(e)}
    out = {}
    for j in range(e):
        gate, up = tensor[j].chunk(2, dim=0)
        out[f"{prefix}.{j}.gate_proj.weight"] = gate
        out[f"{prefix}.{j}.up_proj.weight"] = up
    return out


# config.json fields of the MoE architectures that must be whole numbers >= 1.
_REQUIRED_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def moe_fields_from_hf(raw: dict) -> dict:
    """``ModelConfig`` keyword arguments from a ``qwen2_moe`` / ``qwen3_moe`` config.json; a missing or
    ill-typed field is a ValueError naming it."""
    model_type = raw["model_type"]
    if "num_experts" not in raw and "num_local_experts" in raw:  # transformers 5 writes Qwen3-MoE's this way
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    required = _REQUIRED_MOE_FIELDS + (("shared_expert_intermediate_size",) if model_type == "qwen2_moe" else ())
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"missing required MoE field(s) {missing}")
    problems = [f"{k}={raw[k]!r} must be a whole number >= 1" for k in (*required, "decoder_sparse_step")
                if k in raw and (type(raw[k]) is not int or raw[k] < 1)]
    layers = raw.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(type(i) is int and 0 <= i < raw["num_hidden_layers"] for i in layers):
        problems.append(f"mlp_only_layers={layers!r} must be a list of layer indices below num_hidden_layers")
    coef = raw.get("router_aux_loss_coef", 0.001)
    if type(coef) not in (int, float) or not coef >= 0:
        problems.append(f"router_aux_loss_coef={coef!r} must be a number >= 0")
    for key in ("norm_topk_prob", "output_router_logits"):
        if type(raw.get(key, False)) is not bool:
            problems.append(f"{key}={raw[key]!r} must be true or false")
    if model_type == "qwen3_moe" and raw.get("attention_bias"):
        problems.append("attention_bias=true is not supported for qwen3_moe (its o_proj bias is not modelled)")
    if problems:
        raise ValueError("; ".join(problems))
    return dict(
        num_experts=raw["num_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0,
        norm_topk_prob=raw.get("norm_topk_prob", False), decoder_sparse_step=raw.get("decoder_sparse_step", 1),
        mlp_only_layers=list(layers), router_aux_loss_coef=float(coef),
        output_router_logits=raw.get("output_router_logits", False),
        # Qwen2-MoE names its q/k/v bias `qkv_bias` (default true); Qwen3-MoE has none (its per-head q/k norms are the
        # architecture's trait, `ArchitectureTraits.qk_norm`).
        attention_bias=bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else False,
    )


def moe_fields_to_hf(cfg) -> dict:
    """The MoE and attention fields of a ``qwen2_moe`` / ``qwen3_moe`` config.json."""
    out = dict(
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
        router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=cfg.output_router_logits,
        use_sliding_window=False,
    )
    if cfg.model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=cfg.attention_bias)
    else:
        out["attention_bias"] = False
    return out
