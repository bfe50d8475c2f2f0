"""The model a run trains and its tokenizer: a Hugging Face directory, or the built-in tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM, build_model
from scalerl.models.hf_checkpoint import from_pretrained
from scalerl.models.tokenizer import CharTokenizer, load_tokenizer


def builtin_model_config(model_cfg: Any, tokenizer: CharTokenizer) -> ModelConfig:
    """The built-in tiny Qwen2-shaped model, sized by the `model` config section."""
    return ModelConfig(
        model_type="qwen2",
        vocab_size=128,  # the character vocabulary (99) rounded up, for aligned matmuls
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=model_cfg.dtype,
    )


def tokenizer_source(model_cfg: Any, source: str | None) -> str:
    """Where a run's tokenizer comes from: ``model.tokenizer``, else the model directory when it holds a
    ``tokenizer.json``, else the built-in character tokenizer."""
    if model_cfg.tokenizer:
        return model_cfg.tokenizer
    return source if source and (Path(source) / "tokenizer.json").is_file() else "builtin"


def load_model_and_tokenizer(
    model_cfg: Any, init_from: str | None, device: torch.device, seed: int
) -> tuple[CausalLM, Any]:
    """``init_from`` (e.g. an SFT output) first, then ``model.path``, else a freshly initialised built-in
    model with the character tokenizer."""
    source = init_from or model_cfg.path
    dtype = getattr(torch, model_cfg.dtype)
    if source:
        model = from_pretrained(source, dtype=dtype, device=device)
        tokenizer = load_tokenizer(tokenizer_source(model_cfg, source))
    else:
        tokenizer = load_tokenizer(model_cfg.tokenizer or "builtin")
        if not isinstance(tokenizer, CharTokenizer):
            raise ValueError("the built-in model (model.path unset) only works with model.tokenizer=builtin")
        model = build_model(builtin_model_config(model_cfg, tokenizer), seed=seed, device=device)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size}) is larger than the model's ({model.config.vocab_size}); "
            f"model.tokenizer does not belong to {source or 'the built-in model'}"
        )
    return model, tokenizer
