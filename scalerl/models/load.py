"""The model a run trains and its tokenizer: a Hugging Face directory, or the built-in tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scalerl.core.config import BUILTIN_MAX_POSITIONS, BUILTIN_VOCAB_SIZE, ConfigError
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM, build_model
from scalerl.models.hf_checkpoint import (
    CONFIG_FILE,
    from_pretrained,
    load_model_config,
    read_json_file,
)
from scalerl.models.moe import set_capacity_factor
from scalerl.models.sharded_loading import meta_model
from scalerl.models.tokenizer import CharTokenizer, TokenizerNotFound, load_tokenizer
from scalerl.models.transformers_model import (
    TRANSFORMERS,
    TransformersModelConfig,
    announce_implementation,
    choose_implementation,
    load_transformers_model,
)


def builtin_model_config(model_cfg: Any, tokenizer: CharTokenizer) -> ModelConfig:
    """The built-in tiny Qwen2-shaped model, sized by the `model` config section."""
    return ModelConfig(
        model_type="qwen2",
        vocab_size=BUILTIN_VOCAB_SIZE,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        max_position_embeddings=BUILTIN_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=model_cfg.dtype,
    )


def tokenizer_source(model_cfg: Any, source: str | None, source_key: str = "model.path",
                     tokenizer_key: str = "model.tokenizer") -> str:
    """Where a run's tokenizer comes from: ``model.tokenizer`` (``tokenizer_key``, read as ``model_cfg.tokenizer``)
    when set, the built-in character tokenizer for the built-in model (no ``source``), else the model directory,
    which must then hold ``tokenizer.json``: falling back to the built-in tokenizer would silently train a real
    model on the wrong vocabulary."""
    if model_cfg.tokenizer:
        return model_cfg.tokenizer
    if not source:
        return "builtin"
    if not (Path(source) / "tokenizer.json").is_file():
        raise TokenizerNotFound(
            f"{source_key}={source!r} has no tokenizer.json: set {tokenizer_key}=<directory with tokenizer.json> "
            f"(or {tokenizer_key}=builtin, only for a model trained with the built-in character tokenizer)"
        )
    return source


def load_model_and_tokenizer(
    model_cfg: Any, init_from: str | None, device: torch.device, seed: int, on_meta: bool = False
) -> tuple[CausalLM, Any]:
    """``init_from`` (e.g. an SFT output) first, then ``model.path``, else a freshly initialised built-in
    model with the character tokenizer. ``on_meta``: a model directory's architecture only, on the meta
    device, for `scalerl.models.sharded_loading.load_local_shards` to fill once laid out."""
    source = init_from or model_cfg.path
    dtype = getattr(torch, model_cfg.dtype)
    if source:
        model_type = _model_type(source)
        implementation, why = choose_implementation(model_cfg.implementation, model_type)
        announce_implementation(implementation, why, source)
        if implementation == TRANSFORMERS:
            # transformers builds and fills its own model: loaded whole (no per-rank slices yet).
            model = load_transformers_model(source, dtype=dtype, device=device)
        elif on_meta:  # (MoE checkpoints too: the slice reader knows the per-expert and fused layouts)
            model = meta_model(source, dtype)
        else:
            model = from_pretrained(source, dtype=dtype, device=device)
        source_key = "trainer.init_from" if init_from else "model.path"
        tokenizer = load_tokenizer(tokenizer_source(model_cfg, source, source_key))
    else:
        tokenizer = load_tokenizer(model_cfg.tokenizer or "builtin")
        if not isinstance(tokenizer, CharTokenizer):
            raise ConfigError("the built-in model (model.path unset) only works with model.tokenizer=builtin, got "
                              f"model.tokenizer={model_cfg.tokenizer!r}")
        if model_cfg.implementation == TRANSFORMERS:
            raise ConfigError("model.implementation=transformers loads a Hugging Face directory: set model.path "
                              "(or trainer.init_from); the built-in model is scalerl's own decoder")
        model = build_model(builtin_model_config(model_cfg, tokenizer), seed=seed, device=device)
    try:
        set_capacity_factor(model, getattr(model_cfg, "moe_capacity_factor", None))
    except ValueError as e:
        raise ConfigError(f"{e} ({source or 'the built-in model'})") from None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(
            f"tokenizer vocabulary ({tokenizer.vocab_size}) is larger than the model's ({model.config.vocab_size}); "
            f"model.tokenizer does not belong to {source or 'the built-in model'}"
        )
    return model, tokenizer


def _model_type(source: str) -> str | None:
    path = Path(source) / CONFIG_FILE
    raw = read_json_file(path, "model config") if path.is_file() else {}
    return raw.get("model_type") if isinstance(raw, dict) else None


def model_architecture(model_cfg: Any, source: str) -> ModelConfig:
    """The architecture of the model directory ``source`` as the run would load it (config.json only): a
    `ModelConfig`, or a `TransformersModelConfig` for the transformers fallback."""
    if choose_implementation(model_cfg.implementation, _model_type(source))[0] == TRANSFORMERS:
        return TransformersModelConfig.from_hf_dict(read_json_file(Path(source) / CONFIG_FILE, "model config"))
    return load_model_config(source)
