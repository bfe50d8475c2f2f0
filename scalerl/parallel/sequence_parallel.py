"""Ulysses sequence parallelism (DeepSpeed-Ulysses): the ``parallel.sp`` ranks of one data-parallel replica
each run the decoder on a contiguous 1/sp of every sequence, and attention, which needs the whole sequence,
runs after an all-to-all that trades the sequence shards for head shards, and back after it.

Per forward of a model with ``H`` query heads, ``K`` kv heads and head size ``D``, on a micro-batch of
``B x T`` tokens (``T`` padded up to a multiple of ``S = parallel.sp``):

1. the model's input (ids, positions; the attention mask / packed sequences whole) is cut along the
   sequence (`SequenceParallel.split`, a forward pre-hook): rank ``r`` embeds tokens ``[r T/S, (r+1) T/S)``;
2. in every layer, q, k and v ``[B, heads, T/S, D]`` go through an all-to-all to ``[B, heads/S, T, D]``
   (`SequenceToHeads`), the layer's own attention runs on them (causal, sliding windows, soft caps, packed
   sequences: unchanged; a padded batch's rows causal from their first real column, `LeftPadding`, with no
   ``T x T`` mask), and its output ``[B, H/S, T, D]`` goes back to ``[B, H, T/S, D]`` (`HeadsToSequence`);
   each is the other's backward;
3. the final norm and the head run on this rank's shard only, at the positions the caller keeps
   (`ShardLayout`): the policy's forward returns `SequenceShards` (this rank's logits), whose `per_token`
   computes per-token results (log-probs, entropies) there and all-gathers only those, ``[B, T]`` each; a
   value model's head runs on the shard and its values are gathered the same way. No rank holds a
   whole-sequence ``[T, hidden]`` or ``[T, vocab]`` tensor, and losses, log-prob passes and the critic read
   per-token results of the whole sequence, in the layout they have without sp.

Head rule: sp divides ``H``; kv heads are split the same way when sp divides ``K``, else (``K < S``, ``K``
divides ``S``) each kv head is replicated ``S / K`` times before the exchange, so rank ``r``'s query heads
read kv head ``r // (S / K)``, the one they read without sp (`scalerl.core.config.sequence_parallel_head_problems`).

Bytes, all counted as ``sequence`` traffic on the ``sp`` dimension, per layer and forward (activations of
``e`` bytes): three all-to-alls of ``B (H + 2 K') T/S D e`` bytes in (``K' = max(K, S)``) and one of
``B H T/S D e`` out, each sending ``(S-1)/S`` of its input; the backward the same again; plus one
all-gather of ``B T n`` float32 per-token results per forward (``n``: 2 for the policy loss's log-prob and
entropy, 1 for a log-prob pass or the critic's values; `sequence_parallel_bytes` is the formula).

Gradients: every sp rank computes the same loss on the gathered per-token results, so a rank's gradient is
the contribution of its own tokens, and a replica's gradient is their sum. `GatherSequence`'s backward
scales its slice by S; data parallelism then averages over the ``dp x sp`` ranks (DDP's group, FSDP2's shard
mesh: `gradient_mesh`), which gives the mean over replicas of that sum. Generation (a KV cache) runs unsplit.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        self.mask: LeftPadding | torch.Tensor | PackedSequences | None = None  # the forward in flight's, whole
        self._layout: ShardLayout | None = None  # where the forward in flight's kept positions fall here
        self.values = False  # the decoder is a value model's backbone (`apply_sequence_parallel`)

    # ---- attention: sequence shards <-> head shards ---------------------------------------------------
    def __call__(self, core_attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``core_attention(q, k, v, mask)`` over the whole sequence on ``heads / sp`` heads; q, k, v and
        the result are this rank's sequence shard ``[B, heads, T/S, D]``."""
        if k.shape[1] < self.size:  # fewer kv heads than ranks: replicate so each rank gets its query heads' one
            k = k.repeat_interleave(self.size // k.shape[1], dim=1)
            v = v.repeat_interleave(self.size // v.shape[1], dim=1)
        q, k, v = (SequenceToHeads.apply(t, self) for t in (q, k, v))
        return HeadsToSequence.apply(self.attention(core_attention, q, k, v), self)

    def exchange(self, chunks: torch.Tensor) -> torch.Tensor:
        """All-to-all of ``[S, ...]``: chunk j to sp rank j; returns the chunks received, by source rank."""
        return self.ctx.all_to_all(chunks, over=self.group, kind=KIND, dim="sp")

    # ---- the model's input and output -------------------------------------------------------------------
    def split(self, module: CausalLM, args: tuple, kwargs: dict):
        """Forward pre-hook: this rank's shard of the ids and positions; the whole mask kept for attention
        (a padded batch's as each row's first real column, `LeftPadding`, not a ``T x T`` mask)."""
        input_ids = args[0] if args else kwargs.pop("input_ids")
        args = ()
        if kwargs.get("kv_cache") is not None:  # generation runs unsplit
            self._layout = None
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
            self.mask = LeftPadding.of(mask)
        else:
            self.mask = None  # plain causal
            if positions is None:
                positions = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], -1)
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
        self._layout = ShardLayout(self, length, length + pad, kwargs.get("logits_to_keep", 0), packed,
                                   kwargs.get("return_hidden", False))
        kwargs.update(position_ids=positions[:, self._layout.cut], logits_to_keep=0, return_hidden=True)
        return (input_ids[:, self._layout.cut],), kwargs

    def shard_outputs(self, module: CausalLM, args: tuple, kwargs: dict, output: torch.Tensor):
        """Forward hook on the decoder: its normed hidden states at this rank's kept positions, through the
        head (`SequenceShards`); a value model's backbone hands them to the value head unchanged, whose
        per-token values `gather_values` collects. Only a caller asking the policy itself for hidden states
        gets them gathered to full length."""
        layout = self._layout
        if layout is None:
            return output
        hidden = layout.select(output)
        if self.values:  # the value model's hook gathers what its head makes of these
            return hidden
        self._layout = None
        if layout.hidden:
            return layout.gather(hidden)
        return SequenceShards(module.lm_head(hidden), layout)

    def gather_values(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        """Forward hook on a value model: its per-token values of this rank's shard, gathered ``[B, keep]``."""
        layout, self._layout = self._layout, None
        return output if layout is None else layout.gather(output)

    # ---- padded batches under the exchanged heads ---------------------------------------------------------
    def attention(self, core_attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``core_attention`` over whole sequences on this rank's heads, under ``self.mask``."""
        if not isinstance(self.mask, LeftPadding):
            return core_attention(q, k, v, self.mask)
        return self.mask.attend(core_attention, q, k, v)


class LeftPadding:
    """A padded batch's mask when every row's real tokens are one block from its first real column
    (left-padded prompts, right-padded responses, the sp padding at the end): causal attention on each row
    from that column on, rows with the same first column in one call, so no ``T x T`` mask is built.

    Real queries see exactly the keys `attention_mask_4d` gives them (keys before the block are padding,
    keys after a real query are in its future). A left-padding query sees only itself there, so its output
    is its own value, as here. Right-padding queries see the padding keys before them too (their outputs
    are read by nothing: masked out of every loss, and only later padding queries attend to them)."""

    def __init__(self, first: list[int]):
        self.first = first

    @staticmethod
    def of(mask: torch.Tensor) -> LeftPadding | torch.Tensor:
        """`LeftPadding` for ``mask`` ``[B, T]`` whose real tokens are one block per row, else (holes) the
        ``[B, 1, T, T]`` mask."""
        real = mask.bool()
        first = real.int().argmax(-1)
        last = real.shape[1] - 1 - real.flip(-1).int().argmax(-1)
        count = real.sum(-1)
        if bool(((last - first + 1 == count) | (count == 0)).all()):  # host syncs once a forward, as packing does
            return LeftPadding(first.tolist())
        return attention_mask_4d(mask, mask.shape[1])

    def attend(self, core_attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``core_attention(q, k, v, None)`` (causal) per group of rows from their first real column on."""
        starts = sorted(set(self.first))
        if starts == [0]:
            return core_attention(q, k, v, None)
        parts, order = [], []
        for start in starts:
            rows = [b for b, f in enumerate(self.first) if f == start]
            order += rows
            index = torch.tensor(rows, device=q.device)
            q_b, k_b, v_b = (t.index_select(0, index) for t in (q, k, v))
            part = core_attention(q_b[:, :, start:], k_b[:, :, start:], v_b[:, :, start:], None)
            if start:  # padding queries before the block see only themselves
                part = torch.cat([v_b[:, :, :start].repeat_interleave(q.shape[1] // v.shape[1], dim=1), part], 2)
            parts.append(part)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return torch.cat(parts).index_select(0, inverse.to(q.device))


class ShardLayout:
    """Where one forward's kept positions (the caller's ``logits_to_keep``; all for 0) fall on this rank,
    and how per-token results there go back to the caller's ``[B, keep, ...]`` layout (zeros on padding,
    as without sp).

    ``cut``: this rank's ``T/S`` columns of the (padded up to a multiple of S) input row. Padded batches:
    the kept columns of the shard are one slice (`select`); packed rows: the kept real tokens in the shard
    and the padded-layout slots they fill."""

    def __init__(self, sp: SequenceParallel, length: int, padded_length: int, keep: int,
                 packed: PackedBatch | None, hidden: bool):
        self.sp, self.length, self.keep, self.packed, self.hidden = sp, length, keep, packed, hidden
        self.shard = padded_length // sp.size
        start = sp.rank * self.shard
        self.cut = slice(start, start + self.shard)
        if packed is None:
            first = length - (keep or length)  # the first kept column
            lo, hi = min(max(first, start), start + self.shard), min(max(length, start), start + self.shard)
            self.local = slice(lo - start, max(hi, lo) - start)  # kept columns within the shard
            self.label_cut = slice(lo - first, max(hi, lo) - first)  # the same, within the kept block
        else:
            self.positions, self.slots = packed.kept_tokens(keep)
            mine = (self.positions >= start) & (self.positions < start + self.shard)
            self.local_positions, self.local_slots = self.positions[mine] - start, self.slots[mine]

    def select(self, shard: torch.Tensor) -> torch.Tensor:
        """``[B, T/S, ...]`` outputs of this rank's columns -> those at its kept positions ``[B, m, ...]``."""
        if self.packed is None:
            return shard[:, self.local]
        return shard.index_select(1, self.local_positions)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Per-token ``labels`` ``[B, keep, ...]`` (the caller's layout) -> those of this rank's kept positions."""
        if self.packed is None:
            return labels[:, self.label_cut]
        return labels.flatten(0, 1).index_select(0, self.local_slots).unsqueeze(0)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token results ``[B, m, ...]`` at this rank's kept positions -> ``[B, keep, ...]`` over every
        rank's: each rank fills its ``T/S`` columns (zeros where nothing is kept) and one all-gather joins
        them (`GatherSequence`)."""
        rest = local.shape[2:]
        if self.packed is None:
            before = local.new_zeros(local.shape[0], self.local.start, *rest)
            after = local.new_zeros(local.shape[0], self.shard - self.local.stop, *rest)
            whole = GatherSequence.apply(torch.cat([before, local, after], dim=1), self.sp)
            return whole[:, self.length - (self.keep or self.length):self.length]
        piece = local.new_zeros(1, self.shard, *rest).index_copy(1, self.local_positions, local)
        whole = GatherSequence.apply(piece, self.sp)
        return self.packed.unpack(whole.index_select(1, self.positions), self.slots, self.keep)


@dataclass
class SequenceShards:
    """The policy's output under sp: ``logits`` ``[B, m, V]`` at this rank's kept positions only (`ShardLayout`).
    `per_token` turns them into per-token results and gathers those, so no rank holds whole-sequence
    logits or hidden states. A dataclass, so FSDP2 and autocast find the logits tensor in it (the layout
    is a plain object they pass through)."""

    logits: torch.Tensor
    layout: ShardLayout

    def per_token(self, fn, labels: torch.Tensor) -> torch.Tensor:
        """``fn(logits, labels)`` (float32 logits ``[B, m, V]``, their labels ``[B, m]``) -> ``[B, m, ...]``
        on this rank's positions, gathered to ``[B, keep, ...]``; ``labels`` ``[B, keep]`` are aligned with
        the kept positions. Each rank's results go back once (``sequence`` all-gather of ``B T`` x their
        per-token size)."""
        layout = self.layout
        keep = layout.keep or (layout.packed.padded_shape[1] if layout.packed is not None else layout.length)
        if labels.shape[1] != keep:
            raise ValueError(f"per-token labels cover {labels.shape[1]} positions; the forward kept {keep}")
        local = fn(self.logits.float(), layout.labels(labels))
        if self.logits.requires_grad and not local.requires_grad:
            # Nothing kept on this rank (a shard of prompt only): its backward must still run, since its
            # tokens' keys and values reach the other ranks' queries and the all-to-alls pair up in backward.
            local = local + self.logits.flatten()[:0].sum()
        return layout.gather(local)


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
    lm.register_forward_hook(sp.shard_outputs, with_kwargs=True)
    if lm is not model:  # a value model: its head runs on the shard, then the values are gathered
        sp.values = True
        model.register_forward_hook(sp.gather_values, with_kwargs=True)
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


def sequence_parallel_bytes(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, layers: int, sp: int,
                            outputs_per_token: int, element_bytes: int = 4, backward: bool = True) -> dict[str, float]:
    """Payload bytes one rank counts per forward (and backward) of a ``batch x tokens`` micro-batch
    (``tokens`` a multiple of sp), by op: ``all_to_all`` (4 per layer per pass, activations of
    ``element_bytes``) and ``all_gather`` (the ``outputs_per_token`` float32 per-token results: 2 for the
    policy loss, 1 for a log-prob pass, the critic or SFT)."""
    shard = tokens // sp
    per_head = batch * shard * head_dim * element_bytes
    forward = layers * per_head * (2 * heads + 2 * max(kv_heads, sp))  # q, k, v in and the output back
    return {"all_to_all": forward * (2 if backward else 1),
            "all_gather": batch * tokens * outputs_per_token * 4}


def splits_sequences(model: nn.Module) -> bool:
    """Whether `apply_sequence_parallel` hooked ``model``: its forwards then return this rank's shard (the
    policy's `SequenceShards`) or gathered values, in the padded layout, so packed callers unpack as usual."""
    lm = getattr(model, "backbone", model)
    return isinstance(lm, CausalLM) and any(layer.self_attn.sequence_parallel is not None for layer in lm.layers[:1])
