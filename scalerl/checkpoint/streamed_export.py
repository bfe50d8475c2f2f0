"""A model of any layout written as a Hugging Face directory one tensor at a time: like the source (sharded
safetensors with ``model.safetensors.index.json`` past ``max_shard_bytes``, in the source's dtype), with
no rank ever holding the whole model.

Every rank walks the same tensors in the same order; a sharded tensor (FSDP2 / TP DTensor) is gathered
alone (``full_tensor``), cast to the export dtype, and only rank 0 keeps it, until its shard file is
complete and written. Rank 0's extra memory is one shard file plus one full tensor. The directory is built
aside and swapped in whole, as `save_pretrained`'s is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from scalerl.core.directory_swap import replace_directory, staging_dir
from scalerl.core.file_modes import apply_file_modes
from scalerl.models.hf_checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SINGLE_WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    _hf_name,
    model_config_to_hf,
    read_json_file,
)


def export_dtype(choice: str, source: str | None, trained_dtype: str) -> torch.dtype:
    """The dtype an export writes: ``choice`` itself (float32 / bfloat16 / float16), or for ``source``
    the ``torch_dtype`` of the source directory's config.json (``trained_dtype`` for the built-in model,
    or when the source directory is gone)."""
    if choice != "source":
        return getattr(torch, choice)
    if source and (Path(source) / CONFIG_FILE).is_file():
        # The raw field, so a directory of any architecture (the transformers fallback's too) answers.
        raw = read_json_file(Path(source) / CONFIG_FILE, "model config")
        named = str(raw.get("torch_dtype") or raw.get("dtype") or trained_dtype).removeprefix("torch.")
        if isinstance(getattr(torch, named, None), torch.dtype):
            return getattr(torch, named)
    return getattr(torch, trained_dtype)


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names (sorted) cut into consecutive shards of at most ``max_shard_bytes`` each (a tensor
    larger than that gets a shard of its own), as transformers' ``max_shard_size`` does."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


def _exported_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the model's tensor (sharded or not); a tied head is written once, as the embedding."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {_hf_name(name): t for name, t in state.items()}


def write_hf_model(model: nn.Module, path: str | Path, *, dtype: torch.dtype, max_shard_bytes: int,
                   tokenizer: Any | None = None, is_main: bool = True) -> Path | None:
    """Write ``model`` (a `CausalLM`, whole or laid out) as an HF directory at ``path`` in ``dtype``.

    Every rank of the model's layout calls this (the gathers are collectives); only ``is_main`` writes.
    Returns ``path`` on the main rank, None elsewhere."""
    path = Path(path)
    tensors = _exported_tensors(model)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: t.numel() * itemsize for name, t in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    staged = staging_dir(path) if is_main else None
    try:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards, start=1):
            fname = SINGLE_WEIGHTS_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            content: dict[str, torch.Tensor] = {}
            for name in names:
                tensor = tensors[name].detach()
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if is_main:
                    # A copy in the export dtype: the trained parameter itself is never cast or kept.
                    content[name] = full.to(device="cpu", dtype=dtype, copy=True).contiguous()
                del full
            if is_main:
                save_file(content, str(staged / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in names})
            del content
        if not is_main:
            return None
        if len(shards) > 1:
            (staged / WEIGHTS_INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2))
        _write_configs(model, staged, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(staged)
        apply_file_modes(staged)
        replace_directory(staged, path)
    except BaseException:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    return path


def _write_configs(model: nn.Module, directory: Path, dtype: torch.dtype) -> None:
    cfg = model.config
    hf_cfg = model_config_to_hf(cfg)
    hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (directory / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2))
    gen = {key: getattr(cfg, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(cfg, key) is not None}
    if gen:
        (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(gen, indent=2))
