"""The `model` section (and `model.lora`): which model is trained, the built-in model's shape, its dtype.

The built-in model's shape against the parallel layout and the sequence lengths is a check across sections,
in `scalerl.core.config.root`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scalerl.core.config.tree import Section, _check, _check_choice, opt

# Parameter dtypes: the model's, and also the reward model's, the judge's and FSDP2's compute dtype.
DTYPES = ("float32", "bfloat16", "float16")
MODEL_IMPLEMENTATIONS = ("auto", "scalerl", "transformers")
# The built-in model (model.path unset): its context and its vocabulary (the 99 characters of the built-in
# tokenizer, rounded up for aligned matmuls).
BUILTIN_MAX_POSITIONS = 512
BUILTIN_VOCAB_SIZE = 128


@dataclass
class LoraSection(Section):
    """LoRA adapters on the decoder's linear layers (`scalerl.models.lora`): docs/models.md#lora."""

    name = "model.lora"
    rank: int = opt(0, "adapter rank r; 0 = no adapters (the whole model trains)")
    alpha: float = opt(16.0, "lora_alpha: the adapter's output is scaled by alpha / rank")
    dropout: float = opt(0.0, "dropout on the adapter's input (lora_dropout)", at_least=0.0, at_most=0.99)
    target_modules: list[str] = opt(help="module-name suffixes (q_proj, v_proj, ...) or full names as PEFT takes "
                                         "them, or all-linear = every linear layer of the decoder layers",
                                    factory=lambda: ["all-linear"])
    base_dtype: str | None = opt(None, "dtype the frozen base weights are held in (e.g. bfloat16; the adapters "
                                       "stay float32); null = model.dtype")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.rank >= 0, self._key("rank"), ">= 0 (0 = off)", self.rank)
        _check(p, self.alpha > 0, self._key("alpha"), "> 0", self.alpha)
        _check(p, bool(self.target_modules), self._key("target_modules"), "at least one name (or all-linear)",
               self.target_modules)
        if self.base_dtype is not None:
            _check_choice(p, self._key("base_dtype"), self.base_dtype, DTYPES)
        return p


@dataclass
class ModelSection(Section):
    name = "model"
    path: str | None = opt(None, "Hugging Face model directory; null = the built-in tiny model")
    tokenizer: str | None = opt(None, "tokenizer directory; null = model path ('builtin' chars for the built-in model)")
    hidden_size: int = opt(128, "built-in model: hidden size")
    num_hidden_layers: int = opt(2, "built-in model: decoder layers")
    num_attention_heads: int = opt(4, "built-in model: query heads")
    num_key_value_heads: int = opt(2, "built-in model: key/value heads (grouped-query attention)")
    intermediate_size: int = opt(352, "built-in model: MLP width")
    dtype: str = opt("float32", "parameter dtype: " + " | ".join(DTYPES))
    implementation: str = opt("auto", "decoder: scalerl's own | transformers' AutoModelForCausalLM (DDP/FSDP only) | "
                              "auto = scalerl's for the architectures it implements, else transformers")
    activation_checkpointing: bool = opt(False, "recompute layer activations in backward to save memory")
    moe_capacity_factor: float | None = opt(None, "MoE: each expert takes at most ceil(factor x tokens x top_k / "
                                            "num_experts) assignments per training forward, keeping those with the "
                                            "largest routing weights (moe/dropped_tokens); 0/null = no limit",
                                            at_least=0, at_most=1e6)
    lora: LoraSection = field(default_factory=LoraSection)

    def problems(self) -> list[str]:
        p: list[str] = self.lora.all_problems()
        _check_choice(p, self._key("dtype"), self.dtype, DTYPES)
        _check_choice(p, self._key("implementation"), self.implementation, MODEL_IMPLEMENTATIONS)
        if self.path is not None:
            return p  # the architecture fields below only describe the built-in model
        for attr in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size"):
            _check(p, getattr(self, attr) >= 1, self._key(attr), ">= 1", getattr(self, attr))
        if p:
            return p
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            p.append(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                     f"model.num_attention_heads ({heads})")
        elif (self.hidden_size // heads) % 2:
            # rotary embeddings rotate pairs of channels, so each head needs an even width
            p.append(f"model.hidden_size / model.num_attention_heads = {self.hidden_size // heads} "
                     "must be even (rotary embeddings rotate channel pairs)")
        if heads % kv_heads:
            p.append(f"model.num_attention_heads ({heads}) must be divisible by "
                     f"model.num_key_value_heads ({kv_heads})")
        return p
