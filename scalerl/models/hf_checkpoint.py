"""Hugging Face checkpoint interop: read and write ``config.json`` + (sharded) ``*.safetensors`` directories.

Weights never go through pickle: safetensors only. Errors name the file, field or tensor at fault.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from scalerl.core.directory_swap import (
    built_aside,
    recover_leftovers,
)
from scalerl.core.errors import UserError
from scalerl.core.file_modes import apply_file_modes
from scalerl.models.config import (
    FULL_ATTENTION,
    MOE_ARCHITECTURES,
    SLIDING_ATTENTION,
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
)
from scalerl.models.decoder import CausalLM
from scalerl.models.moe import (
    is_fused_experts_name,
    moe_fields_from_hf,
    moe_fields_to_hf,
    split_fused_experts,
)

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointFormatError(UserError, ValueError):
    """A model directory that scalerl cannot load, with the offending file/field/tensor named."""


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _our_name(hf_name: str) -> str:
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def model_config_from_hf(raw: dict[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
    """Translate an HF ``config.json`` dict (transformers 4.x or 5.x style) into a ``ModelConfig``."""
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{source} must hold a JSON object of model settings, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointFormatError(
            f"{source}: unsupported architecture model_type={model_type!r} architectures={architectures}; "
            f"scalerl loads {sorted(SUPPORTED_ARCHITECTURES.values())}"
        )
    for arch in architectures:
        if arch != SUPPORTED_ARCHITECTURES[model_type]:
            raise CheckpointFormatError(
                f"{source}: architecture {arch!r} is not supported; expected {SUPPORTED_ARCHITECTURES[model_type]!r}"
            )
    if raw.get("mlp_bias"):
        raise CheckpointFormatError(f"{source}: mlp_bias=true is not supported")
    raw = {**TRANSFORMERS_DEFAULTS.get(model_type, {}), **raw}
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise CheckpointFormatError(f"{source}: missing required field(s) {missing}")
    _check_field_types(raw, source)
    # transformers 5 nests rope settings in `rope_parameters`; 4.x uses `rope_theta` + `rope_scaling`.
    rope_params = dict(raw.get("rope_parameters") or {})
    rope_theta = raw.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params
    default_bias = model_type == "qwen2"
    architecture_fields = _architecture_fields_from_hf(raw, model_type, source)
    if "rope_theta" in architecture_fields:  # Gemma 3: a RoPE per layer type
        rope_theta, rope_scaling = architecture_fields.pop("rope_theta"), architecture_fields.pop("rope_scaling")
    try:
        moe_fields = moe_fields_from_hf(raw) if model_type in MOE_ARCHITECTURES else {}
        attention_bias = moe_fields.pop("attention_bias", bool(raw.get("attention_bias", default_bias)))
        return ModelConfig(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim"),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            **architecture_fields,
            **moe_fields,
        )
    except ValueError as err:
        raise CheckpointFormatError(f"{source}: {err}") from err


def model_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict readable by transformers 4.x and 5.x."""
    if hasattr(cfg, "hf_config_dict"):  # the transformers fallback's config carries its own
        return cfg.hf_config_dict()
    out: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": cfg.torch_dtype,
        "use_cache": True,
    }
    if cfg.model_type in MOE_ARCHITECTURES:
        out.update(moe_fields_to_hf(cfg))
    elif cfg.model_type == "llama":
        out["attention_bias"] = cfg.attention_bias
        out["mlp_bias"] = False
    elif cfg.model_type == "qwen2" and not cfg.attention_bias:
        raise CheckpointFormatError("a qwen2 checkpoint must have attention_bias=True (Qwen2 always has q/k/v bias)")
    out.update(_architecture_fields_to_hf(cfg))
    return out


GEMMA_TYPES = ("gemma2", "gemma3_text")
# transformers' values for fields a config.json may leave out, where they differ from the generic ones read
# below (head_dim = hidden_size / num_attention_heads, untied embeddings, no sliding window).
TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "gemma2": {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True, "sliding_window": 4096},
    "gemma3_text": {"head_dim": 256, "max_position_embeddings": 131_072, "tie_word_embeddings": True,
                    "sliding_window": 4096},
}


def _architecture_fields_from_hf(raw: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields that differ between architectures: activation, which layers slide and how
    far, Gemma's attention scale, soft-capping and per-layer-type RoPE. Defaults are transformers'."""
    gemma = model_type in GEMMA_TYPES
    act_field = "hidden_activation" if gemma and raw.get("hidden_activation") else "hidden_act"
    fields: dict[str, Any] = {"hidden_act": raw.get(act_field, "gelu_pytorch_tanh" if gemma else "silu")}
    if fields["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        raise CheckpointFormatError(f"{source}: {act_field}={fields['hidden_act']!r} is not supported; scalerl "
                                    f"supports {list(SUPPORTED_ACTIVATIONS)}")
    layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    qwen = model_type.startswith(("qwen2", "qwen3"))  # MoE variants too
    # Qwen's window counts only with use_sliding_window (some configs carry sliding_window=0 otherwise).
    if window is not None and (type(window) is not int or window < 1) and (raw.get("use_sliding_window") or not qwen):
        raise CheckpointFormatError(f"{source}: sliding_window={window!r} must be a whole number >= 1 or null")
    layer_types = raw.get("layer_types")
    if qwen:
        window = window if raw.get("use_sliding_window") else None
        if window is None:
            layer_types = None  # transformers drops the window: every layer attends fully
        elif layer_types is None:
            first = raw.get("max_window_layers", 28)
            layer_types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    elif model_type == "mistral":
        layer_types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * layers
        if raw.get("attention_bias"):
            raise CheckpointFormatError(f"{source}: attention_bias=true is not supported for mistral")
    elif model_type == "llama":
        window = layer_types = None
    if gemma:
        if raw.get("use_bidirectional_attention"):
            raise CheckpointFormatError(f"{source}: use_bidirectional_attention=true is not supported")
        if layer_types is None:
            every = 2 if model_type == "gemma2" else raw.get("sliding_window_pattern", 6)
            layer_types = [FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION for i in range(layers)]
        fields["query_pre_attn_scalar"] = raw.get("query_pre_attn_scalar", 256)
        fields["final_logit_softcapping"] = raw.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None)
        # Gemma 3's attention never caps its scores in transformers, whatever the field says.
        if model_type == "gemma2":
            fields["attn_logit_softcapping"] = raw.get("attn_logit_softcapping", 50.0)
        for key in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
            value = fields.get(key)
            if value is not None and (type(value) not in (int, float) or not 0 < value < float("inf")):
                raise CheckpointFormatError(f"{source}: {key}={value!r} must be a finite number > 0 or null")
    if model_type == "gemma3_text":
        fields.update(_gemma3_rope_from_hf(raw, source))
    fields["layer_types"] = layer_types if window is not None else None  # no window: all layers attend fully
    fields["sliding_window"] = window
    return fields


def _gemma3_rope_from_hf(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3's global RoPE (``rope_theta``, ``rope_scaling``) for full layers and local base for sliding ones:
    transformers 5 nests them per layer type in ``rope_parameters``, 4.x has ``rope_local_base_freq``."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1_000_000.0), local.get("rope_theta", 10_000.0)
        scaling = full if full.get("rope_type", "default") != "default" else None
        if local.get("rope_type", "default") != "default":
            raise CheckpointFormatError(f"{source}: rope_parameters.sliding_attention.rope_type="
                                        f"{local['rope_type']!r} is not supported (only 'default')")
    else:
        theta = raw.get("rope_theta", params.get("rope_theta", 1_000_000.0))
        local_theta = raw.get("rope_local_base_freq", 10_000.0)
        scaling = raw.get("rope_scaling")
    for key, value in (("rope_theta", theta), ("rope_local_base_freq", local_theta)):
        if type(value) not in (int, float) or not 0 < value < float("inf"):
            raise CheckpointFormatError(f"{source}: {key}={value!r} must be a finite number > 0")
    return {"rope_theta": float(theta), "rope_scaling": scaling, "rope_local_theta": float(local_theta)}


def _architecture_fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of `_architecture_fields_from_hf`, in fields transformers 4.x and 5.x both read."""
    sliding = [t == SLIDING_ATTENTION for t in cfg.layer_types]
    out: dict[str, Any] = {}
    if cfg.model_type.startswith(("qwen2", "qwen3")):
        out["use_sliding_window"] = any(sliding)
        if any(sliding):  # transformers 4.x reads max_window_layers, 5.x layer_types
            out.update(sliding_window=cfg.sliding_window, max_window_layers=sliding.index(True),
                       layer_types=cfg.layer_types)
        if cfg.model_type.startswith("qwen3"):
            out["attention_bias"] = cfg.attention_bias
    elif cfg.model_type == "mistral":
        if len(set(sliding)) > 1:
            raise CheckpointFormatError("a mistral checkpoint slides in every layer or none: layer_types mixes them")
        if cfg.attention_bias:
            raise CheckpointFormatError("a mistral checkpoint has no attention bias: attention_bias must be False")
        out["sliding_window"] = cfg.sliding_window if any(sliding) else None
    elif cfg.model_type in GEMMA_TYPES:
        out.update({
            "hidden_activation": cfg.hidden_act, "attention_bias": cfg.attention_bias,
            "sliding_window": cfg.sliding_window, "layer_types": cfg.layer_types,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
        })
        if cfg.model_type == "gemma3_text":
            out["rope_local_base_freq"] = cfg.rope_local_theta
    elif cfg.sliding_window is not None and any(sliding):
        raise CheckpointFormatError(f"a {cfg.model_type} checkpoint has no sliding-window layers")
    return out


# Fields that must be whole numbers >= 1 when present (a string such as "64" is a broken file, not a number).
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_field_types(raw: dict[str, Any], source: str) -> None:
    """Numbers where numbers belong: every problem named with its field and value."""
    problems = []
    for key in _POSITIVE_INT_FIELDS:
        value = raw.get(key)
        if value is not None and (type(value) is not int or value < 1):
            problems.append(f"{key}={value!r} must be a whole number >= 1")
    for key in ("rope_theta", "rms_norm_eps"):
        value = raw.get(key)
        if value is not None and (type(value) not in (int, float) or not value > 0 or value == float("inf")):
            problems.append(f"{key}={value!r} must be a finite number > 0")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = raw.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(type(i) is int and i >= 0 for i in ids):
            problems.append(f"{key}={value!r} must be a token id (an integer >= 0), a list of them, or null")
    if problems:
        raise CheckpointFormatError(f"{source}: " + "; ".join(problems))


def read_json_file(path: Path, what: str) -> Any:
    """A JSON file's content; unreadable, non-UTF-8 or malformed files are a CheckpointFormatError naming it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointFormatError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): "
                                    f"a {what} must be a JSON text file") from None
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path} is not valid JSON ({err}): a {what} must be a JSON object") from None
    except OSError as err:
        raise CheckpointFormatError(f"{path} cannot be read: {err.strerror or err}") from None


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointFormatError(f"{config_path} not found: a model directory needs {CONFIG_FILE}")
    return model_config_from_hf(read_json_file(config_path, "model config"), str(config_path))


def _weight_files(path: Path) -> list[Path]:
    index = path / WEIGHTS_INDEX_FILE
    if index.is_file():
        content = read_json_file(index, "weights index")
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{index} has no 'weight_map' object")
        for name in set(weight_map.values()):
            # A shard is a file beside the index: a path elsewhere ("../x", "/etc/x") is never followed.
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise CheckpointFormatError(f"{index}: shard {name!r} is not a file name in {path}")
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointFormatError(f"shard {f.name} listed in {index} is missing from {path}")
        return files
    single = path / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise CheckpointFormatError(
        f"no weights in {path}: expected {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} with its shards"
    )


def checkpoint_weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory: its index's shards, or the single file."""
    return _weight_files(Path(path))


def meta_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> tuple[CausalLM, torch.dtype]:
    """The architecture of the HF directory ``path`` on the meta device (nothing allocated, nothing read but
    ``config.json``) and the dtype it is for: ``dtype``, default float32."""
    cfg = load_model_config(path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or torch.float32
    cfg.torch_dtype = str(dtype).removeprefix("torch.")
    with torch.device("meta"):
        return CausalLM(cfg), dtype


def from_pretrained(
    path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> CausalLM:
    """Load an HF directory of a supported architecture (``SUPPORTED_ARCHITECTURES``). ``dtype`` defaults to float32 (the CPU training dtype)."""
    path = Path(path)
    model, dtype = meta_model(path, dtype)
    cfg = model.config
    expected = {name: p for name, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for hf_key in f.keys():
                    name = _our_name(hf_key)
                    if is_fused_experts_name(name) and cfg.num_experts:  # as transformers 5 holds them
                        try:
                            loaded.update(split_fused_experts(name, f.get_tensor(hf_key).to(dtype), cfg))
                        except ValueError as err:
                            raise CheckpointFormatError(f"{file.name}: {err}") from None
                        continue
                    if name not in expected:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue  # some tied checkpoints still store the head; the embedding wins
                        if not hf_key.endswith(_IGNORED_TENSOR_SUFFIXES):
                            unexpected.append(f"{hf_key} (in {file.name})")
                        continue
                    tensor = f.get_tensor(hf_key)
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        raise CheckpointFormatError(
                            f"tensor {hf_key} in {file.name} has shape {tuple(tensor.shape)}, but config.json "
                            f"implies {tuple(expected[name].shape)}"
                        )
                    loaded[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as err:  # empty, truncated or not a safetensors file at all
            size = file.stat().st_size if file.is_file() else 0
            raise CheckpointFormatError(
                f"{file} ({size} bytes) is not a readable safetensors file: {err}; it is probably truncated or "
                "empty - copy or download it again, or save the model again"
            ) from None
    if unexpected:
        raise CheckpointFormatError(f"unexpected tensors in {path}: {unexpected[:10]}")
    missing = [_hf_name(n) for n in expected if n not in loaded]
    if missing:
        raise CheckpointFormatError(f"tensors missing from {path}: {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
    model = model.to_empty(device=device)
    model.load_state_dict(loaded, strict=not cfg.tie_word_embeddings, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype)


def save_pretrained(
    model: CausalLM,
    path: str | os.PathLike,
    max_shard_bytes: int = 4 * 1024**3,
    generation_config: dict[str, Any] | None = None,
    tokenizer: Any | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (or shards + index), ``generation_config.json`` and, when
    given, the ``tokenizer``'s files: a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Everything is written into a fresh hidden sibling directory, given the run's file modes, and swapped in
    for ``path`` as a whole: an interrupted save leaves the old directory intact, and no file of an older
    save survives (a stale ``model.safetensors`` or index from another sharding would be loaded instead).

    The one save for every model class: a model that saves itself (the transformers fallback,
    `scalerl.models.transformers_model.TransformersCausalLM`, whose names and config are transformers' own) is
    handed to its own ``save_pretrained``; anything else but a built-in ``CausalLM`` is refused by type, as
    writing its tensors under the built-in names would load with other logits.
    """
    own_save = getattr(type(model), "save_pretrained", None)
    if own_save is not None:
        return model.save_pretrained(path, tokenizer=tokenizer, max_shard_size=max_shard_bytes)
    if not isinstance(model, CausalLM):
        raise TypeError(f"save_pretrained writes a built-in CausalLM or a model with its own save_pretrained, not a "
                        f"{type(model).__name__}")
    path = Path(path)
    with built_aside(path) as staged:
        _write_model_files(model, staged, max_shard_bytes, generation_config)
        if tokenizer is not None:
            tokenizer.save_pretrained(staged)
        apply_file_modes(staged)
    return path


def _write_model_files(
    model: CausalLM, directory: Path, max_shard_bytes: int, generation_config: dict[str, Any] | None
) -> None:
    cfg = model.config
    state = {_hf_name(n): t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_WEIGHTS_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / fname), metadata=metadata)
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (directory / WEIGHTS_INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    hf_cfg = model_config_to_hf(cfg)
    hf_cfg["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (directory / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2))
    gen = dict(generation_config or {})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, key) is not None:
            gen.setdefault(key, getattr(cfg, key))
    if gen:
        (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(gen, indent=2))


def remove_interrupted_saves(path: str | os.PathLike) -> list[str]:
    """Put right what an interrupted `save_pretrained` into ``path`` left beside it (hidden staging or
    replaced copies, also the ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` of earlier scalerl versions);
    returns what was done. No save into ``path`` may be running."""
    path = Path(path)
    done = recover_leftovers(path.parent, lambda p: (p / CONFIG_FILE).is_file(), names=lambda n: n == path.name)
    if path.parent.is_dir():
        for legacy in sorted(path.parent.glob(f".{path.name}.old-*")) + sorted(path.parent.glob(f".{path.name}.tmp-*")):
            if not legacy.is_dir():
                continue
            if ".old-" in legacy.name and not path.exists() and (legacy / CONFIG_FILE).is_file():
                os.rename(legacy, path)
                done.append(f"restored {path.name} from {legacy.name}")
            else:
                shutil.rmtree(legacy, ignore_errors=True)
                done.append(f"removed {legacy.name}")
    return done
