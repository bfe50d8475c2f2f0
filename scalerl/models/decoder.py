"""The built-in decoder: RMSNorm, RoPE, grouped-query attention, a gated MLP, and per-architecture choices.

Qwen2/Llama are the plain case (SDPA with ``is_causal`` or a padding mask). The others differ in a few module
choices read from ``ModelConfig``: per-head q/k norms (Qwen3, Gemma 3), sliding-window layers (Mistral,
Gemma, Qwen3 with ``use_sliding_window``), Gemma's ``(1 + weight)`` norms around both blocks, scaled
embeddings and capped logits, and Gemma 2's capped attention scores (computed explicitly: SDPA cannot cap).

Packed rows (``attention_mask`` a `scalerl.models.packing.PackedBatch`: several sequences in one row of
real tokens) take `packed_attention`, causal within each sequence; the padded path is untouched.

The module tree is flat (``embed_tokens``, ``layers``, ``norm``, ``lm_head``) so pipeline stages can be cut
from ``model.layers`` and tensor-parallel plans applied by module name; Hugging Face's ``model.`` prefix
is added and removed only at load/save time (``scalerl.models.hf_checkpoint``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scalerl.models.config import SLIDING_ATTENTION, ModelConfig
from scalerl.models.kv_cache import KVCache
from scalerl.models.moe import SparseMoeBlock, is_sparse_layer
from scalerl.models.packing import PackedBatch, PackedSequences
from scalerl.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 and cast back (as HF Qwen2/Llama do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in fp32, cast back at the end (the
    checkpoint stores the offset from one, so a zero weight is the identity scale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return (OffsetRMSNorm if cfg.traits.gemma_norms else RMSNorm)(dim, cfg.rms_norm_eps)


def sliding_window_view(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, query_len: int,
                        window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The keys and values a sliding layer's last ``query_len`` queries can reach, and ``mask`` (``[B, 1, Tq,
    Tk]``, or None for plain causal) narrowed to keys less than ``window`` positions behind each query, as
    transformers' ``sliding_window_overlay``: ``key > query - window``.

    Keys out of every query's reach are sliced off, so a decode step reads ``window`` cached keys, not all.
    Positions are cache indices; with left padding only, real tokens are contiguous, so index distance is
    token distance. A query always keeps itself, so no row empties.
    """
    key_len = k.shape[2]
    first = max(0, key_len - query_len - window + 1)
    if first:
        k, v = k[:, :, first:], v[:, :, first:]
        mask = mask[..., first:] if mask is not None else None
    if key_len - first <= window:
        return k, v, mask  # no remaining key is that far behind any query
    q_pos = torch.arange(key_len - query_len, key_len, device=k.device).unsqueeze(1)
    k_pos = torch.arange(first, key_len, device=k.device).unsqueeze(0)
    band = k_pos > q_pos - window
    if mask is None:
        return k, v, (band & (k_pos <= q_pos))[None, None]
    return k, v, mask & band


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, softcap: float) -> torch.Tensor:
    """Attention whose scores are capped, ``softcap * tanh(scores / softcap)``, before masking and an fp32
    softmax (Gemma 2's eager attention). ``mask`` None means causal (``Tq == Tk``) or a single query."""
    if k.shape[1] != q.shape[1]:  # grouped-query: query head h reads kv head h // group
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and q.shape[2] > 1:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences,
                     window: int | None, scale: float | None, softcap: float | None) -> torch.Tensor:
    """Block-diagonal causal attention over a packed row (``[1, H, N, D]``), each sequence on its own:
    the same scores, windows and caps as the padded path, by ``seqs.kernel`` (`scalerl.models.packing`)."""
    kernel = seqs.kernel
    if kernel == "flash_varlen" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), seqs.cu_seqlens, seqs.cu_seqlens,
            seqs.max_len, seqs.max_len, softmax_scale=scale, causal=True,
            window_size=(window - 1, 0) if window is not None else (-1, -1), softcap=softcap or 0.0)
        return out.transpose(0, 1).unsqueeze(0)
    if kernel == "sdpa_block_mask":
        mask = seqs.block_mask(window)
        if softcap is not None:
            return softcapped_attention(q, k, v, mask, scale if scale is not None else q.shape[-1]**-0.5, softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
                                              scale=scale)
    outs = []
    for q_s, k_s, v_s in zip(*(t.split(seqs.lengths, dim=2) for t in (q, k, v))):
        length, mask = q_s.shape[2], None
        if length == 0:
            outs.append(q_s)
            continue
        if window is not None:
            k_s, v_s, mask = sliding_window_view(k_s, v_s, None, length, window)
        if softcap is not None:
            outs.append(softcapped_attention(q_s, k_s, v_s, mask, scale if scale is not None else q.shape[-1]**-0.5,
                                             softcap))
        else:
            outs.append(F.scaled_dot_product_attention(
                q_s, k_s, v_s, attn_mask=mask, is_causal=mask is None and length > 1,
                enable_gqa=q.shape[1] != k.shape[1], scale=scale))
    return torch.cat(outs, dim=2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # With attention_bias, transformers puts a bias on o as well, except in Qwen2 (q/k/v only).
        o_bias = bias and not cfg.traits.qkv_bias_only
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.traits.qk_norm:  # over each head's features, so it holds for any split of the heads (TP)
            self.q_norm = make_norm(cfg, self.head_dim)
            self.k_norm = make_norm(cfg, self.head_dim)
        self.qk_norm = cfg.traits.qk_norm
        self.sliding_window = cfg.layer_window(layer_idx)
        # None: SDPA's default 1/sqrt(head_dim).
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None
        self.softcap = cfg.attn_logit_softcapping
        self.sequence_parallel = None  # Ulysses: runs `core_attention` on head shards (scalerl.parallel.sequence_parallel)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        cache_start: int,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # Head counts come from the weight shapes so a tensor-parallel shard (fewer local heads) just works.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        # One rotation over q and k heads together: half the small kernels of rotating each.
        q, k = apply_rotary(torch.cat((q, k), dim=1), cos, sin).split((q.shape[1], k.shape[1]), dim=1)
        if self.sequence_parallel is not None and kv_cache is None:
            out = self.sequence_parallel(self.core_attention, q, k, v)
        else:
            out = self.core_attention(q, k, v, mask, kv_cache, cache_start)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, kv_cache: KVCache | None = None,
                       cache_start: int = 0) -> torch.Tensor:
        """Attention of the rotated ``q, k, v`` ``[B, heads, T, D]`` under ``mask``: ``[B, heads, T, D]``.

        Under CPU autocast it runs in fp32 over q/k/v rounded to the autocast dtype, its output rounded to
        that dtype, as the fused decode path computes it (`scalerl.models.decode_model`): CPU bf16 SDPA is
        4-8x slower than fp32 at decode shapes, and with one recipe on both sides a bf16 engine's log-probs
        stand in for the training forward's (`BuiltinEngine.logprobs_match_training_forward`)."""
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            low = torch.get_autocast_dtype("cpu")
            with torch.autocast("cpu", enabled=False):
                out = self._attention(*(t.to(low).float() for t in (q, k, v)), mask, kv_cache, cache_start)
            return out.to(low)
        return self._attention(q, k, v, mask, kv_cache, cache_start)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, kv_cache: KVCache | None,
                   cache_start: int) -> torch.Tensor:
        seq = q.shape[2]
        if isinstance(mask, PackedSequences):  # a packed row: one causal block per sequence
            return packed_attention(q, k, v, mask, self.sliding_window, self.scale, self.softcap)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, cache_start)
        if self.sliding_window is not None:
            k, v, mask = sliding_window_view(k, v, mask, seq, self.sliding_window)
        if self.softcap is not None:
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            out = softcapped_attention(q, k, v, mask, scale, self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1, enable_gqa=q.shape[1] != k.shape[1],
                scale=self.scale,
            )
        return out


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with silu, Gemma's GeGLU with ``gelu_pytorch_tanh``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. With Gemma's norms, ``post_attention_layernorm`` norms the attention output (HF's
    name) and ``pre_/post_feedforward_layernorm`` surround the MLP; otherwise it is the pre-MLP norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = SparseMoeBlock(cfg) if is_sparse_layer(cfg, layer_idx) else SwiGLU(cfg)
        self.gemma_norms = cfg.traits.gemma_norms
        if self.gemma_norms:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        # Gemma 3's sliding layers take the local RoPE tables (`CausalLM.forward`).
        self.local_rope = cfg.rope_local_theta is not None and cfg.layer_types[layer_idx] == SLIDING_ATTENTION

    def forward(self, x, cos, sin, mask, kv_cache=None, cache_start=0):
        if self.gemma_norms:
            attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, cache_start)
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, cache_start)
        return x + self.mlp(self.post_attention_layernorm(x))


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: rows times ``sqrt(hidden_size)`` rounded to the weights' dtype (as transformers
    does: 55.5, not 55.43, for 3072 in bf16). A module, so pipeline stages that copy it keep the scale."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim**0.5, dtype=self.weight.dtype).item()
        return super().forward(input_ids) * scale


class CappedLMHead(nn.Linear):
    """The output projection with Gemma's final soft-capping, ``cap * tanh(logits / cap)`` (elementwise, so
    a vocabulary-sharded head caps its own slice)."""

    def __init__(self, hidden_size: int, vocab_size: int, softcap: float):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x) / self.softcap) * self.softcap


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a model or of a pipeline stage (which keeps them in a dict by layer index)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def attention_mask_4d(key_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Boolean ``[B, 1, Tq, Tk]`` mask (True = attend) for the last ``query_len`` of ``Tk`` positions.

    ``key_mask`` ``[B, Tk]`` marks real (non-padding) tokens. Queries attend causally to real keys; a query
    on a padding position also sees itself, so no row is empty (an empty row makes SDPA return NaN, which
    would poison gradients even though padded outputs are never used).
    """
    if query_len == 1:
        # Decode step: the only query is the newest position, which may see every real key.
        return key_mask.bool()[:, None, None, :]
    key_len = key_mask.shape[1]
    device = key_mask.device
    q_pos = torch.arange(key_len - query_len, key_len, device=device).unsqueeze(1)
    k_pos = torch.arange(key_len, device=device).unsqueeze(0)
    causal = k_pos <= q_pos
    allowed = causal.unsqueeze(0) & key_mask.bool().unsqueeze(1)
    allowed = allowed | (k_pos == q_pos).unsqueeze(0)
    return allowed.unsqueeze(1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift RoPE phases."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


class CausalLM(nn.Module):
    """Decoder-only language model. ``forward`` returns logits ``[B, T, V]`` (or hidden states)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = (ScaledEmbedding if cfg.traits.scaled_embeddings else nn.Embedding)(
            cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        if cfg.final_logit_softcapping is not None:
            self.lm_head = CappedLMHead(cfg.hidden_size, cfg.vocab_size, cfg.final_logit_softcapping)
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.local_rotary = None
        if cfg.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) weights, zero biases, identity norms (HF's ``initializer_range`` scheme)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_start: int = 0,
        logits_to_keep: int = 0,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Run the decoder.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, cache_start + T]`` with 1 for real tokens (covers cached keys too);
                ``None`` means no padding. Or a `PackedBatch` (``input_ids`` is then its ``[1, N]`` row, no
                cache): attention runs per sequence and the output comes back in the padded layout (or,
                built with ``response_tokens``, as the predictions of those tokens only, ``[1, M, ...]``).
            position_ids: ``[B, T]``; derived from ``attention_mask`` when omitted.
            kv_cache: preallocated cache written at ``[cache_start, cache_start + T)``.
            logits_to_keep: if > 0, project only the last ``logits_to_keep`` positions (prefill needs one).
            return_hidden: return the final normed hidden states instead of logits (value heads).
        """
        seq = input_ids.shape[1]
        packed = attention_mask if isinstance(attention_mask, PackedBatch) else None
        if packed is not None:
            attention_mask, position_ids = None, packed.position_ids
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(cache_start, cache_start + seq, device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
            else:
                position_ids = position_ids_from_mask(attention_mask)[:, -seq:]
        mask = packed.sequences if packed is not None else None
        if attention_mask is not None:
            mask = attention_mask_4d(attention_mask, seq)
        elif kv_cache is not None and cache_start > 0:
            # Queries of a later chunk see every cached key: an all-true mask rather than SDPA's is_causal,
            # whose triangle would be aligned to the top-left corner.
            mask = attention_mask_4d(torch.ones(input_ids.shape[0], cache_start + seq, device=input_ids.device), seq)
        # A pipeline stage (`scalerl.parallel.pipeline.DecoderStage`) is this model with the modules it does not
        # hold removed: no embedding after the first stage (``input_ids`` are hidden states then), its layers
        # under their own indices, no norm and head before the last (the hidden states are returned).
        hidden = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        cos, sin = self.rotary(position_ids, hidden.dtype)
        local = self.local_rotary(position_ids, hidden.dtype) if self.local_rotary is not None else (cos, sin)
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            layer_cos, layer_sin = local if layer.local_rope else (cos, sin)
            hidden = layer(hidden, layer_cos, layer_sin, mask, kv_cache, cache_start)
        if self.norm is None:
            return hidden
        if packed is not None:  # norm and head on the real tokens the caller reads, then the padded layout
            positions, slots = packed.kept_tokens(logits_to_keep)
            hidden = self.norm(hidden.index_select(1, positions))
            return packed.unpack(hidden if return_hidden else self.lm_head(hidden), slots, logits_to_keep)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = self.norm(hidden)
        if return_hidden:
            return hidden
        return self.lm_head(hidden)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, seed: int | None = 0, device: str | torch.device = "cpu") -> CausalLM:
    """A randomly initialised model in ``cfg.torch_dtype``; the same seed gives the same weights."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    model = CausalLM(cfg)
    model.reset_parameters(generator=generator)
    return model.to(device=device, dtype=getattr(torch, cfg.torch_dtype))
