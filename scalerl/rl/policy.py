"""Building, loading and saving the policy model with its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM, build_model
from scalerl.models.hf_checkpoint import from_pretrained, save_pretrained
from scalerl.models.tokenizer import CharTokenizer, load_tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


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


def load_policy(cfg: Any, device: torch.device, seed: int) -> tuple[CausalLM, Any]:
    """The model to train and its tokenizer: ``trainer.init_from`` (e.g. an SFT output) first, then
    ``model.path``, else a freshly initialised built-in model with the character tokenizer."""
    source = cfg.trainer.init_from or cfg.model.path
    dtype = getattr(torch, cfg.model.dtype)
    if source:
        model = from_pretrained(source, dtype=dtype, device=device)
        tok_source = cfg.model.tokenizer or (source if (Path(source) / "tokenizer.json").is_file() else "builtin")
        tokenizer = load_tokenizer(tok_source)
    else:
        tokenizer = load_tokenizer(cfg.model.tokenizer or "builtin")
        if not isinstance(tokenizer, CharTokenizer):
            raise ValueError("the built-in model (model.path unset) only works with model.tokenizer=builtin")
        model = build_model(builtin_model_config(cfg.model, tokenizer), seed=seed, device=device)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size}) is larger than the model's ({model.config.vocab_size}); "
            f"model.tokenizer does not belong to {source or 'the built-in model'}"
        )
    model.gradient_checkpointing = cfg.model.activation_checkpointing
    return model, tokenizer


def save_policy(model: CausalLM, tokenizer: Any, path: str | Path, dist_ctx=None) -> Path:
    """An HF-format directory (weights, config, tokenizer) that `from_pretrained` and transformers load.

    Distributed: every rank takes part in gathering the full (unsharded) weights; rank 0 writes them."""
    path = Path(path)
    if dist_ctx is not None and dist_ctx.world_size > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist_ctx.is_main:
            plain = CausalLM(model.config)
            plain.load_state_dict(full, strict=False)
            if model.config.tie_word_embeddings:
                plain.lm_head.weight = plain.embed_tokens.weight
            save_pretrained(plain.to(getattr(torch, model.config.torch_dtype)), path)
            tokenizer.save_pretrained(path)
        dist_ctx.barrier()
        return path
    path = save_pretrained(model, path)
    tokenizer.save_pretrained(path)
    return path


def encode_prompts(tokenizer: Any, prompts: list[str], chat_template: bool = False) -> list[list[int]]:
    """Prompt token ids. Plain: the tokenizer's BOS (when it has one) + the text. With ``chat_template``,
    each prompt becomes a user message rendered by the tokenizer's chat template with the generation prompt
    appended (instruct models); the template supplies its own special tokens, so no BOS is added."""
    if chat_template:
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                    for p in prompts]
        return [tokenizer.encode(text) for text in rendered]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer.encode(p) for p in prompts]
