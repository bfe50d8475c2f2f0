"""``rollout.engine=auto``: the built-in engine or vLLM for this run's model, by a rule calibrated with
``benchmarks/generation.py --engines builtin,vllm`` (docs/performance.md, "vLLM beside the built-in engine").

On small models vLLM's per-step scheduling costs more than the model (on a 2-layer hidden-128 model the
built-in engine was up to several times faster); at a few hundred million parameters its kernels win (on
the Qwen2.5-0.5B shape vLLM generated 1.8-3.7x the built-in engine's tokens/s on two CPU cores, bf16 and
fp32). The rule takes vLLM from `VLLM_MIN_PARAMETERS` up, where it is installed and can run the model, and
says why. It is a rule from those measurements, not a probe of the run's own batch.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

# Between the sizes measured: the small model (4 layers, hidden 256: built-in faster) and the 0.5B shape
# (vLLM faster at batch 16 and 64).
VLLM_MIN_PARAMETERS = 100_000_000
MIN_CPU_HEAD_DIM = 32  # vLLM's CPU attention: "Unsupported CPU attention configuration: head_dim=16"


def choose_engine(model: torch.nn.Module, placement: str, trainer_ranks: int) -> tuple[str, str]:
    """``("builtin" | "vllm", why)`` for ``model`` generating with ``placement`` over ``trainer_ranks``."""
    parameters = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if importlib.util.find_spec("vllm") is None:
        return "builtin", "vLLM is not installed"
    if placement == "colocated" and trainer_ranks > 1:
        return "builtin", f"vLLM colocated runs on one trainer rank only ({trainer_ranks} here)"
    if not torch.cuda.is_available() and head_dim is not None and head_dim < MIN_CPU_HEAD_DIM:
        return "builtin", f"vLLM's CPU attention refuses head_dim {head_dim}"
    if parameters < VLLM_MIN_PARAMETERS:
        return "builtin", (f"{parameters / 1e6:.1f}M parameters < {VLLM_MIN_PARAMETERS / 1e6:.0f}M: vLLM's per-step "
                           "overhead outweighs its kernels at this size")
    return "vllm", f"{parameters / 1e6:.0f}M parameters >= {VLLM_MIN_PARAMETERS / 1e6:.0f}M: vLLM's kernels win"


def resolve_engine(cfg: Any, model: torch.nn.Module, trainer_ranks: int) -> str:
    """``rollout.engine`` with ``auto`` decided (the trainer and every rollout worker decide alike)."""
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    return choose_engine(model, cfg.rollout.placement, trainer_ranks)[0]
