"""The trained model as a Hugging Face directory (weights, config, tokenizer): from a live run of any layout
(`export_hf_model`), or from any checkpoint on disk (`export_checkpoint`, behind ``scalerl export``).

Both write through `write_hf_model`, one tensor at a time, which builds the directory aside and swaps it in
whole; like the source: its dtype (``trainer.export_dtype``), sharded past ``trainer.export_max_shard_size``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalerl.checkpoint.layout import (
    SHARDS_DIR,
    CheckpointError,
    latest_checkpoint,
    read_meta,
    verify_files,
)
from scalerl.checkpoint.reshard import read_full_model
from scalerl.checkpoint.streamed_export import export_dtype, write_hf_model
from scalerl.core.config import ModelSection, TrainerSection, byte_size, config_from_dict
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM
from scalerl.models.hf_checkpoint import (
    CONFIG_FILE,
    load_model_config,
    model_config_from_hf,
    read_json_file,
    save_pretrained,
)
from scalerl.models.load import builtin_model_config, tokenizer_source
from scalerl.models.lora import apply_lora_from_config, has_lora, merge_lora, save_adapter
from scalerl.models.tokenizer import CharTokenizer, load_tokenizer
from scalerl.models.transformers_model import (
    TRANSFORMERS,
    TransformersCausalLM,
    TransformersModelConfig,
    build_transformers_model,
    choose_implementation,
)
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.expert_parallel import gather_experts, uses_expert_parallel

DEFAULT_MAX_SHARD_BYTES = byte_size(TrainerSection.export_max_shard_size)


def export_hf_model(model: CausalLM, tokenizer: Any, path: str | Path, ctx: DistContext | None = None, *,
                    dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """An HF-format directory that `from_pretrained` and transformers load, in ``dtype`` (default: the
    model's own), sharded past ``max_shard_bytes``.

    Distributed: every rank takes part in gathering the weights one tensor at a time (`write_hf_model`);
    rank 0 writes them, holding one shard file beyond its share."""
    path = Path(path)
    fallback = isinstance(model, TransformersCausalLM)  # transformers' model saves itself
    if fallback or uses_expert_parallel(model):
        return _export_whole(model, tokenizer, path, ctx, dtype, fallback)
    write_hf_model(model, path, dtype=dtype or getattr(torch, model.config.torch_dtype),
                   max_shard_bytes=max_shard_bytes, tokenizer=tokenizer, is_main=ctx is None or ctx.is_main)
    if ctx is not None and ctx.world_size > 1:
        ctx.barrier()
    return path


def _export_whole(model: nn.Module, tokenizer: Any, path: Path, ctx: DistContext | None, dtype: torch.dtype | None,
                  fallback: bool) -> Path:
    """The export of a model `write_hf_model` cannot walk tensor by tensor: transformers' own (its
    `save_pretrained`), or one whose experts are split over the ranks (`gather_experts` names them
    globally). Rank 0 holds the whole state dict once."""
    dtype = dtype or getattr(torch, model.config.torch_dtype)
    if ctx is None or ctx.world_size == 1:  # only the fallback: experts are split over 2 ranks or more
        return model.save_pretrained(path, tokenizer=tokenizer)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full.update(gather_experts(model, ctx))  # expert parallelism: each rank holds only its experts
    if ctx.is_main and fallback:
        plain = build_transformers_model(model.config)
        plain.load_state_dict(full)
        plain.save_pretrained(path, tokenizer=tokenizer)
    elif ctx.is_main:
        plain = CausalLM(model.config)
        plain.load_state_dict(full, strict=False)
        if model.config.tie_word_embeddings:
            plain.lm_head.weight = plain.embed_tokens.weight
        save_pretrained(plain.to(dtype), path, tokenizer=tokenizer)
    ctx.barrier()
    return path


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint (holds meta.json); else the latest complete checkpoint in it,
    or in its ``checkpoints/`` (a run's output directory)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(f"{path} is not a checkpoint and holds no complete one (nor does {path / 'checkpoints'})")


def export_checkpoint(checkpoint: str | Path, hf_dir: str | Path, merge: bool = False) -> Path:
    """Write the policy of ``checkpoint`` (single-process or distributed, any layout, RL or SFT) as an HF
    directory at ``hf_dir``. One process; every file is checked against meta.json before it is read. A LoRA
    run's checkpoint is written as its PEFT adapter directory, or with ``merge`` as the merged model."""
    path = find_checkpoint(checkpoint)
    meta = read_meta(path)
    verify_files(path, meta["files"], closed_dirs=(SHARDS_DIR,) if "distributed" in meta else ())
    saved = meta.get("config") or {}
    model_section = config_from_dict(ModelSection, saved.get("model"))
    source = (saved.get("trainer") or {}).get("init_from") or model_section.path
    if source and not Path(source).is_dir() and not model_section.tokenizer:
        raise CheckpointError(f"the checkpoint's model came from {source}, which no longer exists: its tokenizer "
                              "cannot be exported")
    tokenizer = load_tokenizer(tokenizer_source(model_section, source))
    config = _model_config(path, meta, model_section, source)
    config.torch_dtype = model_section.dtype  # what the run trained in, and so what the checkpoint holds
    if isinstance(config, TransformersModelConfig):
        model = build_transformers_model(config)
        read_full_model(path, meta, model.state_dict(), prefix="actor.")
        return model.save_pretrained(Path(hf_dir), tokenizer=tokenizer)
    model = CausalLM(config).to(getattr(torch, model_section.dtype))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    apply_lora_from_config(model, model_section.lora, seed=0)  # the adapters' names and shapes; read below
    read_full_model(path, meta, model.state_dict(), prefix="actor.")  # detached views: filled in place
    if has_lora(model) and not merge:
        return save_adapter(model, Path(hf_dir), base_model=source)
    merge_lora(model)
    trainer = config_from_dict(TrainerSection, {k: v for k, v in (saved.get("trainer") or {}).items()
                                                if k in ("export_dtype", "export_max_shard_size")})
    return write_hf_model(model, Path(hf_dir), dtype=export_dtype(trainer.export_dtype, source, model_section.dtype),
                          max_shard_bytes=byte_size(trainer.export_max_shard_size), tokenizer=tokenizer)


def _model_config(path: Path, meta: dict[str, Any], model_section: ModelSection, source: str | None) -> ModelConfig:
    """The architecture: meta.json's copy, else rebuilt as the trainer built it (the source's config.json,
    or the built-in model sized by the ``model`` section)."""
    raw = meta.get("model_config") or (read_json_file(Path(source) / CONFIG_FILE, "model config") if source else {})
    if raw and choose_implementation(model_section.implementation, raw.get("model_type"))[0] == TRANSFORMERS:
        return TransformersModelConfig.from_hf_dict(raw)
    if meta.get("model_config"):
        return model_config_from_hf(meta["model_config"], f"{path / 'meta.json'} (model_config)")
    if source:
        return load_model_config(source)
    return builtin_model_config(model_section, CharTokenizer())
