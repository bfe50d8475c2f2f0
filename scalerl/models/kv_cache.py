"""A preallocated key/value cache: one allocation per generation call, written in place each step."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for every layer, ``[layers, B, kv_heads, max_len, head_dim]``.

    Preallocating avoids the ``torch.cat`` per layer per token that grows a cache quadratically in copies.
    ``update`` writes the new positions and returns views of the filled prefix for attention.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int) -> "KVCache":
        cfg = model.config
        weight = model.layers[0].self_attn.k_proj.weight
        # Local kv heads from the local weight shape, so a tensor-parallel shard allocates only its own heads
        # (a DTensor's .shape is the global one).
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        local_kv_heads = local.shape[0] // cfg.head_dim
        return cls(cfg.num_hidden_layers, batch_size, local_kv_heads, max_len, cfg.head_dim, local.dtype, local.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to position {end} but the cache holds {self.max_len}")
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
