"""Architecture description of a built-in decoder, in Hugging Face `config.json` field names.

One ``ModelConfig`` covers every dense architecture scalerl implements: what a checkpoint chooses
(sizes, sliding windows, soft-capping, rope bases) are fields read from its ``config.json``; what an
architecture always has (q/k norms, Gemma's norms and scaled embeddings) is its ``ArchitectureTraits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scalerl.models.rope import SUPPORTED_ROPE_TYPES

# model_type -> the transformers class a checkpoint of it names in `architectures`.
SUPPORTED_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ArchitectureTraits:
    """What an architecture always has, whatever its checkpoint says."""

    qkv_bias_only: bool = False  # attention_bias puts biases on q/k/v only, not o (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # RMSNorms scale by (1 + weight), and norm the attention and MLP outputs too
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the model's dtype


ARCHITECTURE_TRAITS = {
    "qwen2": ArchitectureTraits(qkv_bias_only=True),
    "qwen2_moe": ArchitectureTraits(qkv_bias_only=True),
    "qwen3": ArchitectureTraits(qk_norm=True),
    "qwen3_moe": ArchitectureTraits(qk_norm=True),
    "gemma2": ArchitectureTraits(gemma_norms=True, scaled_embeddings=True),
    "gemma3_text": ArchitectureTraits(qk_norm=True, gemma_norms=True, scaled_embeddings=True),
}
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")


@dataclass
class ModelConfig:
    model_type: str = "qwen2"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = True  # Qwen2 has q/k/v bias; Llama does not
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    # Per layer, "full_attention" or "sliding_attention" (None: all full); sliding layers see the last
    # `sliding_window` keys, their own included.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' own RoPE base (default schedule)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma: logits become cap * tanh(logits / cap)
    # Sparse MoE (scalerl.models.moe); num_experts=0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0 = none
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False  # as in transformers: the aux loss is trained only when true
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; scalerl supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; scalerl supports {SUPPORTED_ACTIVATIONS}")
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; scalerl supports "
                             f"{SUPPORTED_ROPE_TYPES}")
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        kinds = {FULL_ATTENTION, SLIDING_ATTENTION}
        if not isinstance(self.layer_types, (list, tuple)) or len(self.layer_types) != self.num_hidden_layers \
                or not all(isinstance(t, str) and t in kinds for t in self.layer_types):
            raise ValueError(f"layer_types={self.layer_types!r} must name {self.num_hidden_layers} layers, each "
                             f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
        self.layer_types = list(self.layer_types)
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        if self.model_type in MOE_ARCHITECTURES:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                 f"num_experts={self.num_experts}")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} and decoder_sparse_step="
                                 f"{self.decoder_sparse_step} must be whole numbers >= 1")
        elif self.num_experts:
            raise ValueError(f"num_experts={self.num_experts} needs a MoE model_type {MOE_ARCHITECTURES}")

    @property
    def traits(self) -> ArchitectureTraits:
        return ARCHITECTURE_TRAITS.get(self.model_type, ArchitectureTraits())

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx``, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None
