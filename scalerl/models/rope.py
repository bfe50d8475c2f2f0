"""Rotary position embeddings (RoPE) with the default, linear and Llama-3 frequency schedules."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``1 / theta^(2i/d)`` for ``i < d/2``, adjusted by the checkpoint's rope scaling.

    ``llama3`` follows Meta's Llama 3.1 recipe: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
    ``.../high_freq_factor`` are kept, and the band between is interpolated smoothly.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r} in the model config; scalerl supports {SUPPORTED_ROPE_TYPES}"
    )


class RotaryEmbedding(torch.nn.Module):
    """Holds a cos/sin table for every position up to ``max_positions``, built once per device, so a forward
    pass only gathers rows (no per-step trigonometry and no host-device sync in the decode loop)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int):
        super().__init__()
        # A plain fp32 CPU tensor, not a buffer: `model.to(bfloat16)` or meta-device construction must not
        # touch it, since low-precision frequencies visibly shift long-context positions.
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.max_positions = max_positions
        self._table: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _cos_sin(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._table:
            positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq.to(device=device, dtype=torch.float32))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._table[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._table[key]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape ``[B, 1, T, head_dim]`` for ``position_ids`` of shape ``[B, T]``."""
        cos, sin = self._cos_sin(position_ids.device, dtype)
        return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]`` over the last dimension."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # One fused multiply-add, as the fused decode path rotates (`scalerl.models.decode_model`), so that a
    # bf16 engine's log-probs equal the training forward's; in fp32 (cos/sin of an fp32 or autocast model).
    if cos.dtype == torch.float32:
        return torch.addcmul(x * cos, rotated, sin)
    return x * cos + rotated * sin
