"""Any other decoder: transformers' own ``AutoModelForCausalLM`` behind the interface scalerl calls on `CausalLM`.

`choose_implementation` picks scalerl's decoder for the architectures it implements and this fallback for the
rest (``model.implementation``). `TransformersCausalLM` takes scalerl's call (``input_ids, attention_mask,
position_ids, kv_cache, cache_start, logits_to_keep, return_hidden``), passes positions counted over real
tokens (left padding) and scalerl's `KVCache` seen through transformers' ``Cache`` interface, so the built-in
engine generates with it unchanged; its ``layers`` are the HF decoder's blocks, which FSDP2 shards one by
one and activation checkpointing wraps. What needs scalerl's own modules (tensor, pipeline and expert
parallelism cut or split them by scalerl's module names) is refused (`transformers_layout_problems`).

transformers is imported only when the fallback is used: scalerl does not depend on it otherwise.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalerl.core.directory_swap import built_aside
from scalerl.core.errors import UserError
from scalerl.core.file_modes import apply_file_modes
from scalerl.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
)
from scalerl.models.decoder import position_ids_from_mask
from scalerl.models.hf_checkpoint import CheckpointFormatError
from scalerl.models.kv_cache import KVCache

logger = logging.getLogger("scalerl.models")

SCALERL, TRANSFORMERS = "scalerl", "transformers"


class TransformersMissing(UserError, ImportError):
    """The fallback was chosen but the transformers package is not installed."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise TransformersMissing(
            "model.implementation=transformers needs the transformers package: pip install transformers"
        ) from None
    return transformers


def choose_implementation(requested: str, model_type: str | None) -> tuple[str, str]:
    """``(implementation, why)`` for a checkpoint of ``model_type``: ``auto`` takes scalerl's own decoder
    when it implements the architecture (read at call time: the set grows), else transformers'."""
    if requested == SCALERL:
        return SCALERL, "model.implementation=scalerl"
    if requested == TRANSFORMERS:
        return TRANSFORMERS, "model.implementation=transformers"
    if model_type in SUPPORTED_ARCHITECTURES:
        return SCALERL, f"model_type={model_type!r} is one scalerl implements (model.implementation=auto)"
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return SCALERL, (f"model_type={model_type!r} is not one scalerl implements and transformers is not installed "
                         "(pip install transformers to run it through model.implementation=transformers)")
    if model_type not in CONFIG_MAPPING:  # nobody knows it: scalerl's loader names the field
        return SCALERL, f"model_type={model_type!r} is known neither to scalerl nor to transformers"
    return TRANSFORMERS, (f"model_type={model_type!r} is not one scalerl implements ({sorted(SUPPORTED_ARCHITECTURES)}); "
                          "transformers' AutoModelForCausalLM runs it (model.implementation=auto)")


def announce_implementation(implementation: str, why: str, source: str) -> None:
    """The start-up line saying which decoder trains and why: logged on every rank, printed on rank 0."""
    text = f"decoder for {source}: {'scalerl' if implementation == SCALERL else 'transformers'} ({why})"
    logger.info(text)
    if os.environ.get("RANK", "0") == "0":
        print(f"[scalerl.models] {text}", flush=True)


@dataclasses.dataclass
class TransformersModelConfig(ModelConfig):
    """A `ModelConfig` read from any HF config (the fields scalerl's trainers, engine, FLOP count and mesh
    checks read), carrying the whole HF config (``hf_config``, a dict) for saving and rebuilding."""

    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:  # any model_type: transformers knows the architecture, not scalerl
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # The FLOP count asks each layer's window: transformers' own `layer_types` where it states them
        # (sliding-window models), else every layer attends to the whole sequence.
        kinds = (FULL_ATTENTION, SLIDING_ATTENTION)
        if not (isinstance(self.layer_types, list) and len(self.layer_types) == self.num_hidden_layers
                and all(t in kinds for t in self.layer_types) and self.sliding_window):
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers

    @classmethod
    def from_hf(cls, hf_config: Any) -> TransformersModelConfig:
        """From a transformers config object (its aliases resolved: GPT-2's ``n_head`` is read as
        ``num_attention_heads``); a multimodal config's text part gives the sizes."""
        text = hf_config.get_text_config()
        hidden, heads = text.hidden_size, text.num_attention_heads
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
        return cls(
            model_type=hf_config.model_type,
            vocab_size=text.vocab_size,
            hidden_size=hidden,
            intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None),
            # No limit stated (e.g. ALiBi models): the engine's length check never fires.
            max_position_embeddings=getattr(text, "max_position_embeddings", None) or 1 << 30,
            attention_bias=bool(getattr(text, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            torch_dtype=str(dtype).removeprefix("torch."),
            layer_types=list(getattr(text, "layer_types", None) or []) or None,
            sliding_window=window if isinstance(window := getattr(text, "sliding_window", None), int) else None,
            hf_config=hf_config.to_dict(),
        )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> TransformersModelConfig:
        """From a ``config.json`` dict (a model directory's, or the one a checkpoint's meta.json records)."""
        return cls.from_hf(_hf_config(raw))

    def hf_config_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (what a checkpoint's meta.json records)."""
        return {**self.hf_config, "dtype": self.torch_dtype}


# ------------------------------------------------------------------------------------------ the KV cache
class _EngineCacheLayer:
    """One layer of scalerl's `KVCache` as a transformers cache layer: keys written at ``start``."""

    is_sliding = False  # the cache holds every position; sliding windows are the attention mask's job
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: KVCache, layer_idx: int, start: int):
        self.cache, self.layer_idx, self.start = cache, layer_idx, start
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(self.layer_idx, key_states, value_states, self.start)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.start + query_length, 0  # (kv_length, kv_offset): every cached key, from position 0

    def get_seq_length(self) -> int:
        return self.start

    def get_max_length(self) -> int:
        return self.cache.max_len


def engine_cache(kv_cache: KVCache, start: int):
    """scalerl's `KVCache` (the engine's, with its row compaction) as a transformers ``Cache`` for one
    forward writing positions ``[start, start + T)``."""
    cache_utils = _transformers().cache_utils
    layer_cls = _layer_class(cache_utils)
    layers = [layer_cls(kv_cache, i, start) for i in range(kv_cache.num_layers)]
    return cache_utils.Cache(layers=layers)


_LAYER_CLASSES: dict[int, type] = {}


def _layer_class(cache_utils) -> type:
    """`_EngineCacheLayer` registered as transformers' ``CacheLayerMixin`` (its checks use isinstance)."""
    key = id(cache_utils)
    if key not in _LAYER_CLASSES:
        _LAYER_CLASSES[key] = type("EngineCacheLayer", (_EngineCacheLayer, cache_utils.CacheLayerMixin),
                                   {"lazy_initialization": lambda self, k, v: None})
    return _LAYER_CLASSES[key]


# ------------------------------------------------------------------------------------------ the model
class TransformersCausalLM(nn.Module):
    """transformers' ``AutoModelForCausalLM`` (``hf``) called as scalerl calls `CausalLM`: ``forward`` returns
    logits ``[B, T, V]`` (or the decoder's final hidden states)."""

    def __init__(self, hf_model: nn.Module, config: TransformersModelConfig):
        super().__init__()
        self.hf = hf_model
        self.config = config
        # transformers 5 names the cache argument `cache`, 4.x `past_key_values`.
        params = inspect.signature(hf_model.forward).parameters
        self._cache_argument = "cache" if "cache" in params else "past_key_values"

    @property
    def decoder(self) -> nn.Module:
        """The HF base model (embeddings, blocks, final norm) without the head."""
        return self.hf.get_decoder()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks, in order (FSDP2 shards and activation checkpointing wraps each)."""
        decoder = self.decoder
        blocks = getattr(decoder, "layers", None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
        for child in decoder.children():  # e.g. GPT-2's `h`
            if isinstance(child, nn.ModuleList) and len(child) == self.config.num_hidden_layers:
                return child
        raise TypeError(f"no list of {self.config.num_hidden_layers} decoder blocks in {type(decoder).__name__}")

    @property
    def embed_tokens(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module | None:
        return self.hf.get_output_embeddings()

    @lm_head.setter
    def lm_head(self, value: nn.Module | None) -> None:
        """``lm_head = None`` (a value model's backbone) drops the HF head, whatever its attribute is named."""
        head = self.hf.get_output_embeddings()
        name = next((n for n, m in self.hf.named_children() if head is not None and m is head), "lm_head")
        setattr(self.hf, name, value)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_start: int = 0,
        logits_to_keep: int = 0,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """`CausalLM.forward`'s contract; transformers builds the attention masks (its sliding windows too)
        from the 2-D ``attention_mask`` over ``cache_start + T`` keys."""
        batch, seq = input_ids.shape
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(cache_start, cache_start + seq, device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand(batch, -1)
            else:
                position_ids = position_ids_from_mask(attention_mask)[:, -seq:]
        cache = engine_cache(kv_cache, cache_start) if kv_cache is not None else None
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, self._cache_argument: cache,
                  "use_cache": cache is not None}
        if return_hidden:
            hidden = self.decoder(input_ids=input_ids, **kwargs).last_hidden_state
            return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return self.hf(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs).logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, path: str | os.PathLike, tokenizer: Any | None = None,
                        max_shard_size: int | str = "4GB") -> Path:
        """transformers' own ``save_pretrained`` (safetensors), written aside and swapped in whole like
        `scalerl.models.hf_checkpoint.save_pretrained`, with the ``tokenizer``'s files when given."""
        path = Path(path)
        with built_aside(path) as staged:
            self.hf.save_pretrained(staged, max_shard_size=max_shard_size)
            if tokenizer is not None:
                tokenizer.save_pretrained(staged)
            apply_file_modes(staged)
        return path


def load_transformers_model(path: str | os.PathLike, dtype: torch.dtype, device: str | torch.device = "cpu"
                            ) -> TransformersCausalLM:
    """An HF directory of any architecture transformers knows, with SDPA attention, in ``dtype``."""
    transformers = _transformers()
    hf_config = without_dropout(transformers.AutoConfig.from_pretrained(str(path)))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), config=hf_config, dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    # transformers fills missing tensors with random values and only warns: a broken directory would train.
    for kind in ("missing_keys", "mismatched_keys"):
        if info.get(kind):
            names = sorted(str(k) for k in info[kind])
            raise CheckpointFormatError(f"{path}: {kind.replace('_', ' ')} for {type(hf).__name__}: {names[:10]}"
                                        + (" ..." if len(names) > 10 else ""))
    return _wrap(hf.to(device), dtype)


def build_transformers_model(config: TransformersModelConfig, dtype: torch.dtype | None = None,
                             device: str | torch.device = "cpu") -> TransformersCausalLM:
    """An uninitialised model of ``config``'s architecture (allocated, not random-filled), to load a state
    dict into: exporting a checkpoint, or gathering a sharded model's weights."""
    transformers = _transformers()
    dtype = dtype or getattr(torch, config.torch_dtype)
    hf_config = _hf_config(config.hf_config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to_empty(device=device)
    hf.tie_weights()  # meta -> real storage makes new tensors: the tied head points at the embedding again
    return _wrap(hf, dtype)


def without_dropout(hf_config: Any) -> Any:
    """``hf_config`` with every dropout probability (``*dropout*``, ``*pdrop``) set to 0, its text part's too:
    the rollout's log-probs (eval mode) and the update's (train mode) must be of one function, as with
    scalerl's decoder, which has no dropout."""
    for config in {id(c): c for c in (hf_config, hf_config.get_text_config())}.values():
        for key, value in config.to_dict().items():
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value:
                setattr(config, key, 0.0)
    return hf_config


def _hf_config(raw: dict[str, Any]) -> Any:
    """transformers' config object for a ``config.json`` dict."""
    fields = {k: v for k, v in raw.items() if k not in ("transformers_version", "model_type")}
    return _transformers().AutoConfig.for_model(raw.get("model_type"), **fields)


def _wrap(hf: nn.Module, dtype: torch.dtype) -> TransformersCausalLM:
    config = TransformersModelConfig.from_hf(hf.config)
    config.torch_dtype = str(dtype).removeprefix("torch.")
    return TransformersCausalLM(hf, config)


# ------------------------------------------------------------------------------------------ layouts
# The layouts that cut or split scalerl's own modules by their names, and so cannot take transformers' model.
_SCALERL_ONLY_LAYOUTS = (("tp", "tensor parallelism"), ("pp", "pipeline parallelism"), ("ep", "expert parallelism"))


def transformers_layout_problems(parallel: Any, model_type: str | None = None) -> list[str]:
    """Each of ``parallel``'s dimensions (a ParallelSection or ParallelDims) the fallback cannot run, named."""
    what = f"model_type={model_type!r} through transformers" if model_type else "transformers' model"
    return [f"parallel.{dim}={getattr(parallel, dim)} ({name}) needs scalerl's own decoder modules, but {what} "
            "(model.implementation=transformers) trains under DDP and FSDP2 only: set parallel.tp=1, parallel.pp=1, "
            "parallel.ep=1 and use parallel.dp_replicate / parallel.dp_shard"
            for dim, name in _SCALERL_ONLY_LAYOUTS if (getattr(parallel, dim, 1) or 1) > 1]


def layout_refusal(model: nn.Module, dims: Any) -> str | None:
    """Why ``model`` (a policy or a value model around one) cannot be laid out on ``dims``, or None."""
    if not isinstance(getattr(model, "backbone", model), TransformersCausalLM):
        return None
    problems = transformers_layout_problems(dims, model.config.model_type)
    return "; ".join(problems) or None
