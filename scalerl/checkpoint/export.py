"""The trained model as a Hugging Face directory (weights, config, tokenizer), from any layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scalerl.models.decoder import CausalLM
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.parallel.distributed import DistContext


def export_hf_model(model: CausalLM, tokenizer: Any, path: str | Path, ctx: DistContext | None = None) -> Path:
    """An HF-format directory that `from_pretrained` and transformers load.

    Distributed: every rank takes part in gathering the full (unsharded) weights; rank 0 writes them."""
    path = Path(path)
    if ctx is None or ctx.world_size == 1:
        path = save_pretrained(model, path)
        tokenizer.save_pretrained(path)
        return path
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        plain = CausalLM(model.config)
        plain.load_state_dict(full, strict=False)
        if model.config.tie_word_embeddings:
            plain.lm_head.weight = plain.embed_tokens.weight
        save_pretrained(plain.to(getattr(torch, model.config.torch_dtype)), path)
        tokenizer.save_pretrained(path)
    ctx.barrier()
    return path
