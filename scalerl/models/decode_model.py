"""The decoder's generation forward over weights laid out once per weight sync for the kernels that read them.

`DecodeModel` holds, per layer, q/k/v packed into one ``[q + 2 kv, hidden]`` matrix (with its bias) and
gate/up into one ``[2 intermediate, hidden]`` matrix, in the engine's compute dtype and, on CPU, reordered
into oneDNN's blocked format (`PackedLinear`), so a layer makes four matmul calls where the training layout
makes seven, and in bf16 reads half the bytes of fp32 weights without casting them per call (autocast's
per-call cast of fp32 weights costs more than the bf16 kernel saves). A decode step is about 200 ops (242
before): RoPE is applied to q, k and v in one three-op pass straight off the q/k/v product and the new keys
and values go into the cache in one copy (`KVCache.update_kv`); sampling takes one pass over the
vocabulary fewer (`scalerl.rollout.engines.sampling`).

Numerics follow bf16 autocast of the training forward (`scalerl.models.decoder.CausalLM` under
``torch.autocast``): matmuls in the compute dtype; the residual stream, norms, RoPE and the logits' softmax
in fp32; q/k/v rounded to the compute dtype for attention, which runs in fp32 over those values (bf16 SDPA
is 4-8x slower on CPU at decode shapes). In fp32 every cast is a no-op and the result is the model's own
forward but for the matmuls' summation order (tested: tokens equal, log-probs within 1e-5).

``refresh`` lays the model's parameters out again (after an optimizer step or a weight load); ``is_stale``
reads the parameters' version counters, which every in-place write (optimizer step, ``copy_`` of a weight
load) bumps, so a forgotten refresh cannot generate with old weights.

Fused here: Qwen2, Qwen3 (q/k norms), Llama, Mistral and sliding-window layers, with or without LoRA
adapters (their merged weights are packed). Not fused, so `fused_decode_unsupported` names why and the
engine runs the model's own forward: Gemma 2/3 (offset norms around both blocks, scaled embeddings,
capped scores and logits, local RoPE), sparse-MoE layers, and sharded or pipeline-cut models (FSDP,
tensor parallel: their parameters are DTensors or a stage holds only some layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalerl.core.cpu_capabilities import cpu_capabilities
from scalerl.models.decoder import SwiGLU, attention_mask_4d, position_ids_from_mask, sliding_window_view
from scalerl.models.kv_cache import KVCache
from scalerl.models.lora import LoRALinear


def fused_decode_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the fused decode path (None: it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not isinstance(getattr(model, "layers", None), nn.ModuleList):
        return "not a whole built-in CausalLM (a pipeline stage or another model class)"
    if cfg.traits.gemma_norms or cfg.traits.scaled_embeddings or cfg.rope_local_theta is not None:
        return f"{cfg.model_type}: Gemma's offset norms, scaled embeddings and local RoPE are not fused"
    if cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
        return f"{cfg.model_type}: soft-capped scores or logits are not fused"
    if any(not isinstance(layer.mlp, SwiGLU) for layer in model.layers):
        return f"{cfg.model_type}: sparse-MoE layers are not fused"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "sharded parameters (FSDP or tensor parallel): each forward gathers them"
    return None


def _weight_and_bias(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight as generation applies it: LoRA adapters merged in."""
    if isinstance(linear, LoRALinear):
        merged = linear.merged()
        return merged.weight.detach(), None if merged.bias is None else merged.bias.detach()
    return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()


# oneDNN's blocked weight layout on CPU: reordered once per sync, read by `_linear_pointwise`. Measured on
# one core (AMD EPYC, AVX-512 BF16): 1.3-2.1x faster than F.linear on the plain bf16 tensor at decode
# shapes (it re-reads the plain layout each call), same bits; in fp32 1.3-2.7x faster from 16 rows on for
# matrices from 1376 x 256 up, ~1e-6 relative apart (summation order). But each `_linear_pointwise` call
# costs about 18 us however small the product, where F.linear on a plain fp32 matrix costs 3-6 us: plain
# fp32 is faster up to 256 x 256 at any row count and ties at 512 x 256 (`benchmarks/generation.py
# --linear-layouts`, docs/performance.md), so fp32 matrices up to FP32_PLAIN_MAX elements stay plain (the tiny model's
# all, the small model's q/k/v, o and LM head). The row count the blocked layout is tuned for; other counts
# run as fast. The layout is used only where this CPU runs it (`cpu_capabilities`, probed once per process):
# on a CPU without AVX-512 or AVX-NE-CONVERT oneDNN has no bf16 reorder, and bf16 weights stay plain.
PACK_ROWS = 16
FP32_PLAIN_MAX = 512 * 256


def blocked_layout(weight: torch.Tensor) -> bool:
    """Whether `PackedLinear` lays ``weight`` out in oneDNN's blocked format: on a CPU whose oneDNN runs that
    dtype's kernel, for bf16 weights and fp32 ones over FP32_PLAIN_MAX elements."""
    if weight.device.type != "cpu" or not (
            weight.dtype == torch.bfloat16 or (weight.dtype == torch.float32 and weight.numel() > FP32_PLAIN_MAX)):
        return False
    return cpu_capabilities().onednn_blocked(weight.dtype)


class PackedLinear:
    """One weight matrix (and bias) laid out for the kernel that reads it: oneDNN's blocked format on a CPU
    that runs it (`blocked_layout`), the plain tensor elsewhere (GPUs' matmuls read the plain one at full
    speed, and so does any CPU torch supports)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, blocked: bool = True):
        self.nbytes = weight.numel() * weight.element_size()
        self.bias = bias
        self.onednn = blocked and blocked_layout(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if self.onednn else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)


@dataclass
class LayerWeights:
    """One layer's tensors in the decode layout (norm weights fp32, prescaled for `rms_norm`: the norms run
    in fp32), and the modules the decode path calls as they are."""

    attn: nn.Module  # its q/k norms, sliding window and scale
    act: Callable[[torch.Tensor], torch.Tensor]
    input_norm: torch.Tensor
    qkv: PackedLinear  # [q + k + v, hidden], compute dtype
    o: PackedLinear
    post_norm: torch.Tensor
    gate_up: PackedLinear  # [2 * intermediate, hidden], compute dtype
    down: PackedLinear


class DecodeModel:
    """A built-in ``CausalLM``'s forward for generation, over packed (and, in bf16, cast) weights."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32, compile: bool = False):
        reason = fused_decode_unsupported(model)
        if reason is not None:
            raise ValueError(f"no fused decode path: {reason}")
        self.model, self.dtype, self.config = model, dtype, model.config
        # ``compile``: the forward through torch.compile (``dynamic=True``: the cache grows every step, the
        # batch shrinks at compactions), over plain weights, as the compiler cannot read oneDNN's opaque
        # blocked tensors. Off by default: measured slower to warm up than it saves (docs/performance.md).
        self.compiled = compile
        self._forward = torch.compile(self._eager_forward, dynamic=True) if compile else self._eager_forward
        self.layers: list[LayerWeights] = []
        self._versions: tuple[int, ...] = ()
        self.refresh()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (every packed matrix and the LM head, not the embedding
        table, of which a step gathers a row per sequence)."""
        mats = [m for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [self.lm_head]
        return sum(m.nbytes for m in mats)

    def _version_key(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.model.parameters())

    def is_stale(self) -> bool:
        """Whether a parameter was written since the last ``refresh`` (optimizer step, weight load)."""
        return self._version_key() != self._versions

    def refresh(self) -> int:
        """Lay the model's current parameters out again; returns the bytes of the layout. Under inference
        mode, as generation reads them."""
        # The old layout goes before the new one is built, so the new one takes its memory: built beside it, a
        # colocated rank held two copies at every weight sync (0.11 GiB more on the 0.5B-shaped plan cell).
        # Until the new one is whole the model reads as stale, and generation lays it out again.
        self._versions, self.layers, self.lm_head = (), [], None
        with torch.inference_mode():
            self.layers = [self._layer_weights(layer) for layer in self.model.layers]
            lm_head, _ = _weight_and_bias(self.model.lm_head)
            self.lm_head = PackedLinear(lm_head.to(self.dtype), None, not self.compiled)
            self.final_norm = self._norm_weight(self.model.norm.weight)
            self._norm_eps = self.config.hidden_size * self.config.rms_norm_eps
        self._versions = self._version_key()
        return self.weight_bytes

    def _layer_weights(self, layer: nn.Module) -> LayerWeights:
        attn, mlp, dtype, blocked = layer.self_attn, layer.mlp, self.dtype, not self.compiled
        (q, qb), (k, kb), (v, vb) = (_weight_and_bias(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        o, ob = _weight_and_bias(attn.o_proj)
        (gate, _), (up, _) = _weight_and_bias(mlp.gate_proj), _weight_and_bias(mlp.up_proj)
        down, _ = _weight_and_bias(mlp.down_proj)
        return LayerWeights(
            attn=attn, act=mlp.act,
            input_norm=self._norm_weight(layer.input_layernorm.weight),
            qkv=PackedLinear(torch.cat((q, k, v)).to(dtype), None if qb is None else torch.cat((qb, kb, vb)).to(dtype),
                             blocked),
            o=PackedLinear(o.to(dtype), None if ob is None else ob.to(dtype), blocked),
            post_norm=self._norm_weight(layer.post_attention_layernorm.weight),
            gate_up=PackedLinear(torch.cat((gate, up)).to(dtype), None, blocked),
            down=PackedLinear(down.to(dtype), None, blocked),
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's weight times sqrt(hidden), as `rms_norm` takes it (it sums where the model's norm averages)."""
        return weight.detach().float() * self.config.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kv_cache: KVCache, cache_start: int,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)[:, -input_ids.shape[1]:]
        if kv_cache.keys is None:  # fp32 entries (holding compute-dtype values): see the attention below
            cfg = self.config
            kv_cache.allocate(cfg.num_key_value_heads, cfg.head_dim, torch.float32, input_ids.device)
        self._rope_tables(input_ids.device)  # built here, outside a compiled forward
        return self._forward(input_ids, attention_mask, kv_cache, cache_start, position_ids, logits_to_keep)

    __call__ = forward

    def _eager_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kv_cache: KVCache,
                       cache_start: int, position_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Logits ``[B, T or logits_to_keep, V]`` (compute dtype) of ``input_ids`` ``[B, T]`` written into
        ``kv_cache`` at ``cache_start``: `CausalLM.forward`'s arguments, ``attention_mask`` ``[B, cache_start
        + T]`` (1 = real token) required.

        Per layer a decode step runs about 20 ops: the norms, four matmuls, the rotation (three ops over
        q, k and v together: v's heads get cos 1 and sin 0, which leaves them as they are), one copy of
        the new keys and values into the cache, attention, the gate and the residual adds."""
        cfg, dtype = self.config, self.dtype
        bsz, seq = input_ids.shape
        eps, heads, kv_heads, head_dim = self._norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        all_heads = heads + 2 * kv_heads
        # An additive mask, built once for all layers: SDPA's CPU kernel runs faster with it than with a
        # boolean one (221 vs 286 us at batch 16, 48 keys). A decode step's one query sees every real key.
        mask = attention_mask.bool()[:, None, None, :] if seq == 1 else attention_mask_4d(attention_mask, seq)
        bias = torch.where(mask, 0.0, float("-inf"))
        hidden = self.model.embed_tokens(input_ids).float()  # the module: its hooks see the fused forwards too
        cos, signed_sin = self._rotation(position_ids, bsz, seq, heads + kv_heads)
        half = head_dim // 2
        # Below fp32, the norms' and the rotation's last op writes its result rounded to the compute dtype
        # into these (one allocation per forward, not a cast per use: each is read before the next write).
        normed = rotated = None
        if dtype != torch.float32:
            normed = torch.empty(bsz, seq, cfg.hidden_size, dtype=dtype, device=input_ids.device)
            rotated = torch.empty(bsz, seq, all_heads, head_dim, dtype=dtype, device=input_ids.device)
        for index, lw in enumerate(self.layers):
            attn = lw.attn
            qkv = lw.qkv(rms_norm(hidden, lw.input_norm, eps, normed)).view(bsz, seq, all_heads, head_dim)
            if attn.qk_norm:  # the model's own modules: the same numerics as its (autocast) forward
                q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=2)
                qkv = torch.cat((attn.q_norm(q), attn.k_norm(k), v), dim=2)
            # One rotation over all heads in fp32 (cos/sin are), as autocast's forward rotates q and k, as
            # three ops (rotate_half(x) * sin == roll(x, half) * signed_sin), then rounded to the compute
            # dtype as autocast's attention takes q, k and v (the fp32 cache holds the rounded values).
            qkv = torch.addcmul(qkv * cos, qkv.roll(half, dims=-1), signed_sin, out=rotated).transpose(1, 2)
            keys, values = kv_cache.update_kv(index, qkv[:, heads:], cache_start)
            q = qkv[:, :heads].float()
            layer_mask = bias
            if attn.sliding_window is not None:
                keys, values, layer_mask = sliding_window_view(keys, values, mask, seq, attn.sliding_window)
            # In fp32 over compute-dtype values: bf16 SDPA on CPU measured 4-8x slower than fp32 at decode
            # shapes (1.7 ms vs 0.29 ms, batch 16), and its output is rounded to bf16 below as autocast's is.
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=layer_mask,
                                                 enable_gqa=heads != kv_heads, scale=attn.scale)
            hidden = hidden + lw.o(out.transpose(1, 2).reshape(bsz, seq, heads * head_dim).to(dtype))
            gate, up = lw.gate_up(rms_norm(hidden, lw.post_norm, eps, normed)).chunk(2, dim=-1)
            hidden = hidden + lw.down(lw.act(gate) * up)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.lm_head(rms_norm(hidden, self.final_norm, eps, None if normed is None else normed[:, -hidden.shape[1]:]))

    def _rotation(self, position_ids: torch.Tensor, bsz: int, seq: int, rotated_heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[B, T, heads + 2 kv_heads, head_dim]`` for one forward (every layer's):
        the positions' table rows for the q and k heads, 1 and 0 for the v heads."""
        table, cfg = self._rope, self.config
        both = torch.empty(2, bsz, seq, cfg.num_attention_heads + 2 * cfg.num_key_value_heads, cfg.head_dim,
                           device=position_ids.device)
        both[:, :, :, :rotated_heads] = table[:, position_ids].unsqueeze(3)
        both[0, :, :, rotated_heads:] = 1.0
        both[1, :, :, rotated_heads:] = 0.0
        return both[0], both[1]

    def _rope_tables(self, device: torch.device) -> torch.Tensor:
        """The model's fp32 cos table and its sin table with the first half negated, ``[2, positions, head_dim]``."""
        if getattr(self, "_rope", None) is None or self._rope.device != device:
            positions = torch.arange(self.config.max_position_embeddings, device=device).unsqueeze(0)
            cos, sin = (t[0, 0] for t in self.model.rotary(positions, torch.float32))
            half = sin.shape[-1] // 2
            self._rope = torch.stack((cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)))
        return self._rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in fp32 as ``x * rsqrt(x . x + n eps) * (weight sqrt(n))``,
    five ops (``weight`` and ``eps`` given prescaled, `DecodeModel._norm_weight`): ``F.rms_norm``'s CPU
    kernel took 34 us at a decode step's ``[16, 1, 256]`` where these take about 12 us; a mean takes 6.1 us
    where a sum takes 3.3 and ``vecdot`` (square and sum in one) 3.3 us; the fp32 result differs from the
    mean's in the last bits. ``out``: where the
    result goes, rounded to its dtype (as ``.to(dtype)`` rounds)."""
    return torch.mul(x * torch.rsqrt(torch.linalg.vecdot(x, x).add_(eps)).unsqueeze(-1), weight, out=out)
