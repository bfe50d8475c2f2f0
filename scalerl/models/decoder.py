"""A Qwen2/Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, optional q/k/v bias.

The module tree is flat (``embed_tokens``, ``layers``, ``norm``, ``lm_head``) so pipeline stages can be cut
from ``model.layers`` and tensor-parallel plans applied by module name; Hugging Face's ``model.`` prefix
is added and removed only at load/save time (``scalerl.models.hf_checkpoint``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scalerl.models.config import ModelConfig
from scalerl.models.kv_cache import KVCache
from scalerl.models.moe import SparseMoeBlock, is_sparse_layer
from scalerl.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 and cast back (as HF Qwen2/Llama do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


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
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of queries and keys, before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

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
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        # One rotation over q and k heads together: half the small kernels of rotating each.
        q, k = apply_rotary(torch.cat((q, k), dim=1), cos, sin).split((q.shape[1], k.shape[1]), dim=1)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, cache_start)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1, enable_gqa=q.shape[1] != k.shape[1]
        )
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg) if is_sparse_layer(cfg, layer_idx) else SwiGLU(cfg)

    def forward(self, x, cos, sin, mask, kv_cache=None, cache_start=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, cache_start)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) weights, zero biases, unit norms (HF's ``initializer_range`` scheme)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

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
                ``None`` means no padding.
            position_ids: ``[B, T]``; derived from ``attention_mask`` when omitted.
            kv_cache: preallocated cache written at ``[cache_start, cache_start + T)``.
            logits_to_keep: if > 0, project only the last ``logits_to_keep`` positions (prefill needs one).
            return_hidden: return the final normed hidden states instead of logits (value heads).
        """
        seq = input_ids.shape[1]
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(cache_start, cache_start + seq, device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
            else:
                position_ids = position_ids_from_mask(attention_mask)[:, -seq:]
        mask = None
        if attention_mask is not None:
            mask = attention_mask_4d(attention_mask, seq)
        elif kv_cache is not None and cache_start > 0:
            # Queries of a later chunk see every cached key: an all-true mask rather than SDPA's is_causal,
            # whose triangle would be aligned to the top-left corner.
            mask = attention_mask_4d(torch.ones(input_ids.shape[0], cache_start + seq, device=input_ids.device), seq)
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, kv_cache, cache_start)
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
