"""Every random-number stream a training run draws from, captured and restored for bitwise resume:
Python's `random`, NumPy's global state, torch CPU and CUDA generators, and named `torch.Generator`s
(the update shuffler, a sampler). The captured dict holds only tensors and plain values, so it loads with
`torch.load(weights_only=True)`."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (the start of every run)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def reseed_after_reshard(seed: int, step: int, generators: dict[str, torch.Generator]) -> None:
    """Seed the global generators and ``generators`` from ``(seed, step)``, alike on every rank: a run
    resumed under another layout has no saved stream for its ranks, so it starts deterministic ones of its own.

    Not per rank: ranks that hold the same rows (the TP, SP and PP peers of one data-parallel rank) must draw
    the same mini-batch shuffle and the same global draws (LoRA dropout, ...), or their micro-batches differ
    in width and their collectives mismatch. A fresh run seeds every rank alike (`seed_everything`, the update
    shuffler from the seed), with data-parallel ranks told apart by their rows, not their streams; this keeps
    to that, whatever the new layout's mesh."""
    derived = ((seed * 1_000_003 + step) * 65_537) % 2**63
    seed_everything(derived)
    for offset, name in enumerate(sorted(generators), start=1):
        generators[name].manual_seed((derived + offset) % 2**63)


def capture_rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        # numpy arrays are not allowed under weights_only loading, so the key goes in as a tensor.
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: generator.get_state() for name, generator in generators.items()},
    }


def restore_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator], *, restore_global: bool) -> None:
    for name, generator in generators.items():
        generator.set_state(state["generators"][name])
    if not restore_global:
        return
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    saved_numpy = state["numpy"]
    np.random.set_state(
        (
            saved_numpy["kind"],
            saved_numpy["keys"].numpy().astype(np.uint32),
            saved_numpy["position"],
            saved_numpy["has_gauss"],
            saved_numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state["torch_cuda"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_states and len(cuda_states) != visible:
        warnings.warn(
            f"checkpoint holds CUDA RNG states for {len(cuda_states)} device(s) but {visible} are visible; "
            f"restoring the first {min(len(cuda_states), visible)}, CUDA random numbers will differ",
            stacklevel=3,
        )
    for device, device_state in enumerate(cuda_states[:visible]):
        torch.cuda.set_rng_state(device_state, device)
