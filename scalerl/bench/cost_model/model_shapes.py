"""Architectures the cost model projects to, as data: the Qwen2.5 family's `config.json` shapes (0.5B-72B),
so projections need no download. Each becomes a `ModelConfig`, whose parameter and FLOP counts come from
`scalerl.perf.flops` like those of any loaded model.
"""

from __future__ import annotations

from scalerl.models.config import ModelConfig

# Fields of each model's config.json on the Hugging Face hub (Qwen/Qwen2.5-<size>): hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size,
# tie_word_embeddings. All have q/k/v biases (Qwen2 architecture).
QWEN25_SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, 152064, False),
}
# Parameter counts the model cards state ("Number of Parameters"), in billions: what the shapes must give.
QWEN25_CARD_PARAMS_B = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.61,
                        "qwen2.5-14b": 14.7, "qwen2.5-32b": 32.5, "qwen2.5-72b": 72.7}


def model_shape(name: str) -> ModelConfig:
    """The `ModelConfig` of a named architecture (``qwen2.5-7b``; ``7b`` alone means Qwen2.5)."""
    key = name.lower()
    if key not in QWEN25_SHAPES and f"qwen2.5-{key}" in QWEN25_SHAPES:
        key = f"qwen2.5-{key}"
    if key not in QWEN25_SHAPES:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(QWEN25_SHAPES)}")
    hidden, intermediate, layers, heads, kv_heads, vocab, tied = QWEN25_SHAPES[key]
    return ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       attention_bias=True, tie_word_embeddings=tied, torch_dtype="bfloat16",
                       extra={"name": key})
