"""Architecture description of a Qwen2/Llama-family decoder, in Hugging Face `config.json` field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
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
    qk_norm: bool = False  # Qwen3(-MoE): RMSNorm over each query/key head before RoPE
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
        if self.model_type in MOE_ARCHITECTURES:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                 f"num_experts={self.num_experts}")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} and decoder_sparse_step="
                                 f"{self.decoder_sparse_step} must be whole numbers >= 1")
        elif self.num_experts:
            raise ValueError(f"num_experts={self.num_experts} needs a MoE model_type {MOE_ARCHITECTURES}")
