"""Loading a Hugging Face directory into a model that is already laid out (FSDP2 / TP DTensors), each rank
reading only its own slices, so no rank ever holds a full copy.

The flow: `meta_model` builds the architecture on the meta device (no memory), the caller lays it out
(``fully_shard`` / ``parallelize_module`` work on meta tensors), then `load_local_shards` allocates each
rank's local shards (``to_empty``) and fills them from the safetensors files through ``get_slice``, which
reads the mmapped file's rows and columns of that slice only. Peak host memory per rank: its share of the
parameters plus one slice in the file's dtype. Errors name the tensor and file at fault, as
`from_pretrained`'s do.

A rank that loads its share is one meant to stay near it, so loading also pins glibc's mmap threshold
(`pin_mmap_threshold`): by default glibc raises the threshold to the size of each mmapped block freed (up
to 32 MiB), after which a layer's gradients and FSDP's reduce-scatter buffers (1-32 MiB each) come from
the heap, and once freed stay resident there; pinned at 128 KiB every such buffer is unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from scalerl.models.decoder import CausalLM
from scalerl.models.hf_checkpoint import (
    _IGNORED_TENSOR_SUFFIXES,
    CheckpointFormatError,
    _hf_name,
    _weight_files,
)
from scalerl.models.hf_checkpoint import meta_model as hf_meta_model
from scalerl.models.moe import (
    check_fused_experts_shape,
    expert_index,
    fused_expert_block,
    is_fused_experts_name,
    moe_blocks,
)

# A value model's backbone is the policy's checkpoint; its head has no tensor there and starts at zero.
_BACKBONE_PREFIX = "backbone."
_FRESH_ZERO_PREFIXES = ("value_head.",)


def meta_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> CausalLM:
    """The architecture of the HF directory ``path`` on the meta device, in ``dtype`` (default float32):
    nothing allocated and nothing read but ``config.json``; `load_local_shards` fills it once laid out."""
    model, dtype = hf_meta_model(path, dtype)
    return model.to(dtype)


def is_on_meta(model: nn.Module) -> bool:
    """True when ``model``'s parameters are still unallocated (built by `meta_model`, not yet loaded)."""
    return any(p.is_meta for p in model.parameters())


# glibc's mallopt parameter and the value MALLOC_MMAP_THRESHOLD_=131072 would set (glibc's own default start).
_M_MMAP_THRESHOLD = -3
PINNED_MMAP_THRESHOLD = 128 * 1024


def pin_mmap_threshold(threshold: int = PINNED_MMAP_THRESHOLD) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, threshold)`` for this process (glibc only; a user's own
    ``MALLOC_MMAP_THRESHOLD_`` wins): allocations above it are mmapped and unmapped when freed, and the
    threshold no longer climbs. Returns whether it was set. It stays set: glibc cannot go back to the
    climbing threshold, and what it guards against (freed step buffers kept in the heap) comes after
    loading."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # ValueError where the name is unknown (not glibc)
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError, ValueError):  # not glibc after all (musl, macOS): nothing to pin
        return False


def _checkpoint_name(param_name: str) -> str:
    return _hf_name(param_name.removeprefix(_BACKBONE_PREFIX))


def _tensor_index(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the file holding it (headers only are read)."""
    where: dict[str, Path] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    where[key] = file
        except (SafetensorError, OSError) as err:
            size = file.stat().st_size if file.is_file() else 0
            raise CheckpointFormatError(
                f"{file} ({size} bytes) is not a readable safetensors file: {err}; it is probably truncated or "
                "empty - copy or download it again, or save the model again") from None
    return where


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """The region of the full tensor that this rank's local shard of ``param`` holds (all of it for a plain
    tensor). FSDP2's ``Shard(0)`` and TP's ``Shard(0)`` / ``Shard(1)`` (and their compositions) each
    leave one rectangular block per rank."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def load_local_shards(model: nn.Module, path: str | os.PathLike, device: str | torch.device = "cpu") -> int:
    """Allocate ``model``'s local shards on ``device`` and copy each from the HF directory ``path``, reading
    only this rank's slice of every tensor; returns the bytes read from the files.

    ``model`` is a `meta_model` (or a value model around one) laid out in place. Tied embeddings are one
    parameter and loaded once; a value head (absent from the checkpoint) starts at zero; rotary tables
    are not parameters and were computed at construction. MoE experts are read in either layout: per
    expert, or fused as transformers 5 writes them (each expert's block of ``gate_up_proj`` /
    ``down_proj``, `fused_expert_block`); under expert parallelism only the experts this rank holds, and
    the others' tensors are not unexpected."""
    path = Path(path)
    cfg = getattr(getattr(model, "backbone", model), "config", None)
    tied = getattr(cfg, "tie_word_embeddings", False)
    pin_mmap_threshold()  # before the shards are allocated: they and everything after stay out of the heap
    _allocate_keeping_ties(model, device)
    where = _tensor_index(path)
    used: set[str] = set()
    bytes_read = 0
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.startswith(_FRESH_ZERO_PREFIXES):
                    param.zero_()
                    continue
                key, box = _checkpoint_name(name), local_box(param)
                if key not in where:
                    key, box = _fused_expert_source(name, key, box, where, cfg, path)
                file = where[key]
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt", device="cpu").__enter__()
                source = handles[file].get_slice(key)
                if len(box) == len(param.shape) and tuple(source.get_shape()) != tuple(param.shape):
                    raise CheckpointFormatError(
                        f"tensor {key} in {file.name} has shape {tuple(source.get_shape())}, but config.json "
                        f"implies {tuple(param.shape)}")
                if len(box) > len(param.shape):  # one expert's block of a fused tensor
                    _check_fused_shape(key, tuple(source.get_shape()), cfg, file)
                piece = source[box].reshape([b.stop - b.start for b in box[-len(param.shape):]])
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(piece)
                bytes_read += piece.numel() * piece.element_size()
                del piece
                used.add(key)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    unexpected = [f"{key} (in {file.name})" for key, file in where.items()
                  if key not in used and not key.endswith(_IGNORED_TENSOR_SUFFIXES)
                  and not (key == "lm_head.weight" and (tied or _is_value_model(model)))
                  and not _another_ranks_expert(key, model, cfg)]
    if unexpected:
        raise CheckpointFormatError(f"unexpected tensors in {path}: {unexpected[:10]}")
    return bytes_read


def _fused_expert_source(name: str, key: str, box: tuple[slice, ...], where: dict[str, Path], cfg, path: Path
                         ) -> tuple[str, tuple[slice, ...]]:
    """For a per-expert weight the checkpoint holds fused: the fused tensor and the box of ``box`` in it
    (the expert's index, then its rows shifted to its block); otherwise a missing tensor, named."""
    block = fused_expert_block(name.removeprefix(_BACKBONE_PREFIX), cfg) if getattr(cfg, "num_experts", 0) else None
    if block is not None and _hf_name(block[0]) in where:
        fused, j, first_row = block
        rows = box[0]
        return _hf_name(fused), (slice(j, j + 1), slice(first_row + rows.start, first_row + rows.stop), *box[1:])
    raise CheckpointFormatError(f"tensors missing from {path}: [{key!r}] (for parameter {name})")


def _check_fused_shape(key: str, shape: tuple[int, ...], cfg, file: Path) -> None:
    try:
        check_fused_experts_shape(key.removeprefix("model."), shape, cfg)
    except ValueError as err:
        raise CheckpointFormatError(f"{file.name}: {err}") from None


def _another_ranks_expert(key: str, model: nn.Module, cfg) -> bool:
    """Under expert parallelism, a checkpoint tensor of experts this rank does not hold (per expert, of an
    expert the config has; or fused, whose blocks of them went unread)."""
    if not getattr(cfg, "num_experts", 0) or not any(b.expert_dispatch is not None for b in moe_blocks(model)):
        return False
    name = key.removeprefix("model.")
    j = expert_index(name)
    return (j is not None and j < cfg.num_experts) or is_fused_experts_name(name)


def _allocate_keeping_ties(model: nn.Module, device: str | torch.device) -> None:
    """``model.to_empty(device)``, with parameters shared between modules (tied embeddings) still shared:
    ``to_empty`` gives each module a new parameter of its own wherever a plain meta tensor cannot be
    swapped in place (FSDP2's DTensors can; TP leaves a tied embedding a plain tensor)."""
    first: dict[int, str] = {}
    shared: list[tuple[str, str]] = []  # (name of a later use, name of the first)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    model.to_empty(device=device)
    for name, owner in shared:
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, model.get_parameter(owner))


def _is_value_model(model: nn.Module) -> bool:
    """A value model drops the policy's head: the checkpoint's ``lm_head.weight`` is expected and unused."""
    return hasattr(model, "backbone")
