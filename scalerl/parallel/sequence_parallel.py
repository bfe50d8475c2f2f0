"""Ulysses sequence parallelism (DeepSpeed-Ulysses): the ``parallel.sp`` ranks of one data-parallel replica
each run the decoder on a contiguous 1/sp of every sequence, and attention, which needs the whole sequence,
runs after an all-to-all that trades the sequence shards for head shards, and back after it.

Per forward of a model with ``H`` query heads, ``K`` kv heads and head size ``D``, on a micro-batch of
``B x T`` tokens (``T`` padded up to a multiple of ``S = parallel.sp``):

1. the model's input (ids, positions; the attention mask / packed sequences whole) is cut along the
   sequence (`SequenceParallel.split`, a forward pre-hook): rank ``r`` embeds tokens ``[r T/S, (r+1) T/S)``;
2. in every layer, q, k and v ``[B, heads, T/S, D]`` go through an all-to-all to ``[B, heads/S, T, D]``
   (`SequenceToHeads`), the layer's own attention runs on them (causal, padding masks, sliding windows,
   soft caps, packed sequences: unchanged), and its output ``[B, H/S, T, D]`` goes back to ``[B, H, T/S, D]``
   (`HeadsToSequence`); each is the other's backward;
3. the final normed hidden states are all-gathered along the sequence (`GatherSequence`) and the head runs
   on the positions the loss reads (a forward hook), so losses, log-prob passes and the critic read the
   whole sequence as they do without sp.

Head rule: sp divides ``H``; kv heads are split the same way when sp divides ``K``, else (``K < S``, ``K``
divides ``S``) each kv head is replicated ``S / K`` times before the exchange, so rank ``r``'s query heads
read kv head ``r // (S / K)``, the one they read without sp (`scalerl.core.config.sequence_parallel_head_problems`).

Bytes, all counted as ``sequence`` traffic on the ``sp`` dimension, per layer and forward (fp32 activations
of ``e`` bytes): three all-to-alls of ``B (H + 2 K') T/S D e`` bytes in (``K' = max(K, S)``) and one of
``B H T/S D e`` out, each sending ``(S-1)/S`` of its input; the backward the same again; plus one
all-gather of ``B T hidden e`` per forward (`sequence_parallel_bytes` is the formula).

Gradients: every sp rank computes the same loss on the gathered outputs, so a rank's gradient is the
contribution of its own tokens, and a replica's gradient is their sum. `GatherSequence`'s backward scales
its slice by S; data parallelism then averages over the ``dp x sp`` ranks (DDP's group, FSDP2's shard
mesh: `gradient_mesh`), which gives the mean over replicas of that sum. Generation (a KV cache) runs unsplit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scalerl.core.config import sequence_parallel_head_problems
from scalerl.models.decoder import CausalLM, attention_mask_4d, position_ids_from_mask
from scalerl.models.packing import PackedBatch, PackedSequences
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.mesh import LayoutError

KIND = "sequence"


class SequenceParallel:
    """The sp group of one rank and the attention mask of the forward in flight (set by `split`); the
    callable each attention layer runs around its core attention (``Attention.sequence_parallel``)."""

    def __init__(self, ctx: DistContext, group, size: int, rank: int):
        self.ctx, self.group, self.size, self.rank = ctx, group, size, rank
        self.mask: torch.Tensor | PackedSequences | None = None  # whole-sequence mask of the current forward
        self._call: dict | None = None  # what the caller asked of the forward in flight (keep, hidden, ...)

    # ---- attention: sequence shards <-> head shards ---------------------------------------------------
    def __call__(self, core_attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``core_attention(q, k, v, mask)`` over the whole sequence on ``heads / sp`` heads; q, k, v and
        the result are this rank's sequence shard ``[B, heads, T/S, D]``."""
        if k.shape[1] < self.size:  # fewer kv heads than ranks: replicate so each rank gets its query heads' one
            k = k.repeat_interleave(self.size // k.shape[1], dim=1)
            v = v.repeat_interleave(self.size // v.shape[1], dim=1)
        q, k, v = (SequenceToHeads.apply(t, self) for t in (q, k, v))
        return HeadsToSequence.apply(core_attention(q, k, v, self.mask), self)

    def exchange(self, chunks: torch.Tensor) -> torch.Tensor:
        """All-to-all of ``[S, ...]``: chunk j to sp rank j; returns the chunks received, by source rank."""
        return self.ctx.all_to_all(chunks, over=self.group, kind=KIND, dim="sp")

    # ---- the model's input and output -------------------------------------------------------------------
    def split(self, module: CausalLM, args: tuple, kwargs: dict):
        """Forward pre-hook: this rank's shard of the ids and positions; the whole mask kept for attention."""
        input_ids = args[0] if args else kwargs.pop("input_ids")
        args = ()
        if kwargs.get("kv_cache") is not None:  # generation runs unsplit
            self._call = None
            return (input_ids,), kwargs
        mask, positions = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
        packed = mask if isinstance(mask, PackedBatch) else None
        length = input_ids.shape[1]
        pad = -length % self.size
        if packed is not None:  # the padding forms one more sequence of its own, attended by nothing real
            positions = packed.position_ids
            self.mask = packed.sequences if not pad else PackedSequences(
                torch.tensor([*packed.sequences.lengths, pad]), packed.sequences.kernel)
        elif mask is not None:
            mask = torch.nn.functional.pad(mask, (0, pad))
            positions = position_ids_from_mask(mask) if positions is None else positions
            self.mask = attention_mask_4d(mask, length + pad)
        else:
            self.mask = None  # plain causal
            if positions is None:
                positions = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], -1)
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
        shard = (length + pad) // self.size
        cut = slice(self.rank * shard, (self.rank + 1) * shard)
        self._call = {"length": length, "packed": packed, "keep": kwargs.get("logits_to_keep", 0),
                      "hidden": kwargs.get("return_hidden", False)}
        kwargs.update(position_ids=positions[:, cut], logits_to_keep=0, return_hidden=True)
        return (input_ids[:, cut],), kwargs

    def gather(self, module: CausalLM, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        """Forward hook: the normed hidden states of the whole sequence, then the head where the caller's
        ``logits_to_keep`` (and a packed batch's real tokens) asks for it."""
        call, self._call = self._call, None
        if call is None:
            return output
        hidden = GatherSequence.apply(output, self)[:, :call["length"]]
        packed, keep = call["packed"], call["keep"]
        if packed is not None:
            positions, slots = packed.kept_tokens(keep)
            hidden = hidden.index_select(1, positions)
            return packed.unpack(hidden if call["hidden"] else module.lm_head(hidden), slots, keep)
        if keep:
            hidden = hidden[:, -keep:]
        return hidden if call["hidden"] else module.lm_head(hidden)


def _sequence_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[B, H, T/S, D]`` (this rank's tokens, every head) -> ``[B, H/S, T, D]`` (every token, its heads)."""
    b, h, t, d = x.shape
    s = sp.size
    received = sp.exchange(x.reshape(b, s, h // s, t, d).transpose(0, 1).contiguous())  # [S source shard, ...]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // s, s * t, d)


def _heads_to_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[B, H/S, T, D]`` -> ``[B, H, T/S, D]``: the inverse of `_sequence_to_heads`."""
    b, h, t, d = x.shape
    s = sp.size
    received = sp.exchange(x.reshape(b, h, s, t // s, d).permute(2, 0, 1, 3, 4).contiguous())  # [S head group, ...]
    return received.transpose(0, 1).reshape(b, s * h, t // s, d)


class SequenceToHeads(torch.autograd.Function):
    """Sequence shards to head shards; its backward is the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        fctx.sp = sp
        return _sequence_to_heads(x, sp)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        return _heads_to_sequence(grad.contiguous(), fctx.sp), None


class HeadsToSequence(torch.autograd.Function):
    """Head shards back to sequence shards; its backward is `SequenceToHeads`' forward."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        fctx.sp = sp
        return _heads_to_sequence(x, sp)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        return _sequence_to_heads(grad.contiguous(), fctx.sp), None


class GatherSequence(torch.autograd.Function):
    """``[B, T/S, ...]`` shards all-gathered into ``[B, T, ...]``. Every sp rank computes the same loss on
    the result, so the backward keeps this rank's slice of the gradient, times S: the replica's gradient
    is the sum of its sp ranks' (data parallelism averages over them, module docstring)."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        fctx.sp, fctx.shard = sp, x.shape[1]
        gathered = sp.ctx.all_gather(x.transpose(0, 1).contiguous(), over=sp.group, kind=KIND, dim="sp")
        return gathered.transpose(0, 1)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        start = fctx.sp.rank * fctx.shard
        return grad[:, start:start + fctx.shard] * fctx.sp.size, None


def apply_sequence_parallel(model: nn.Module, ctx: DistContext) -> SequenceParallel:
    """Split ``model``'s (or a value model's backbone's) forwards over the ``sp`` mesh dimension: the
    input and output hooks on the decoder, the all-to-all around every layer's attention."""
    lm = getattr(model, "backbone", model)
    if not isinstance(lm, CausalLM):
        raise LayoutError(f"parallel.sp={ctx.dims.sp} hooks scalerl's own decoder, got {type(lm).__name__}; "
                          "use model.implementation=scalerl or parallel.sp=1")
    cfg = lm.config
    problems = sequence_parallel_head_problems(ctx.dims.sp, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               "model ")
    if problems:
        raise LayoutError("; ".join(problems))
    group = ctx.mesh["sp"].get_group()
    sp = SequenceParallel(ctx, group, ctx.dims.sp, ctx.mesh["sp"].get_local_rank())
    lm.register_forward_pre_hook(sp.split, with_kwargs=True)
    lm.register_forward_hook(sp.gather, with_kwargs=True)
    for layer in lm.layers:
        layer.self_attn.sequence_parallel = sp
    return sp


def gradient_mesh(ctx: DistContext, shard: bool) -> DeviceMesh:
    """The mesh data parallelism reduces gradients over when sp > 1: the sp ranks join the data-parallel
    ones. DDP (``shard=False``): ``(dp_replicate, sp)`` flattened; FSDP2: ``(dp_shard, sp)`` flattened,
    with ``dp_replicate`` beside it for HSDP."""
    mesh, dims = ctx.mesh, ctx.dims
    if not shard:
        return mesh["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp")
    sharded = mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    if dims.dp_replicate == 1:
        return sharded
    return mesh["dp_replicate", "dp_shard_sp"]


def sequence_parallel_bytes(batch: int, tokens: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                            layers: int, sp: int, element_bytes: int = 4, backward: bool = True) -> dict[str, float]:
    """Payload bytes one rank counts per forward (and backward) of a ``batch x tokens`` micro-batch
    (``tokens`` a multiple of sp), by op: ``all_to_all`` (4 per layer per pass) and ``all_gather``."""
    shard = tokens // sp
    per_head = batch * shard * head_dim * element_bytes
    forward = layers * per_head * (2 * heads + 2 * max(kv_heads, sp))  # q, k, v in and the output back
    return {"all_to_all": forward * (2 if backward else 1),
            "all_gather": batch * tokens * hidden * element_bytes}
