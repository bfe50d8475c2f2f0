"""``rollout.engine=auto``: the built-in engine or vLLM for this run's model and step, by a rule calibrated with
``benchmarks/generation.py --engines builtin,vllm`` and ``benchmarks/generation_vllm.py --grpo``
(docs/performance.md, "vLLM beside the built-in engine").

Two measured costs decide it. On small models vLLM's per-step scheduling costs more than the model (on a
2-layer hidden-128 model the built-in engine was up to several times faster); at a few hundred million
parameters its kernels win (on the Qwen2.5-0.5B shape vLLM generated 1.8-3.7x the built-in engine's tokens/s
on two CPU cores). But a GRPO step also loads the new weights into vLLM, every step: on CPU that load
(checksummed on both sides, re-packed for vLLM's kernels) cost about 60 ns per parameter, as much as the
whole decoding saving of some thousands of generated tokens (both scale with the parameter count, so the
break-even is a number of tokens, whatever the size). The rule therefore takes vLLM from
`VLLM_MIN_PARAMETERS` up where it is installed and can run the model, and, on CPU, only where an engine
generates at least `VLLM_CPU_MIN_TOKENS_PER_STEP` tokens per step (`generated_tokens_per_engine`: every row
to ``rollout.max_new_tokens``, an upper bound). It says why. It is a rule from those measurements, not a
probe of the run's own batch; on GPUs (untested here) the load goes over the device and only the size
counts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from scalerl.rollout.engines.vllm import MIN_CPU_HEAD_DIM

# Between the sizes measured: the small model (4 layers, hidden 256: built-in faster) and the 0.5B shape
# (vLLM faster at batch 16 and 64).
VLLM_MIN_PARAMETERS = 100_000_000
# On CPU, generated tokens per step (per engine) below which vLLM's per-step weight load costs more than its
# faster decoding saves. Measured (docs/performance.md): the load 51-65 ns per parameter above the built-in
# engine's sync (benchmarks/generation_vllm.py --grpo), the decoding saving 13-44 ps per parameter and token
# (the tokens/s rows on the 0.5B shape): break-even 1200-5000 tokens. The upper end, because the two
# mistakes are not alike: vLLM picked wrongly made a step 2.9-3.7x slower (32 tokens a step), the built-in
# engine picked wrongly costs at most generation's share of the step (16% at 2048 tokens on the 0.5B shape).
VLLM_CPU_MIN_TOKENS_PER_STEP = 4096


def generated_tokens_per_engine(cfg: Any) -> int:
    """The most tokens one engine generates in a step: every row of the step (``trainer.batch_size`` prompts x
    ``rollout.n``) to ``rollout.max_new_tokens``, split over the standalone workers. An upper bound: rows
    that stop early generate less."""
    r = cfg.rollout
    engines = r.workers if r.placement == "standalone" else 1
    return cfg.trainer.batch_size * r.n * r.max_new_tokens // max(1, engines)


def choose_engine(model: torch.nn.Module, placement: str, trainer_ranks: int,
                  tokens_per_step: int | None = None) -> tuple[str, str]:
    """``("builtin" | "vllm", why)`` for ``model`` generating with ``placement`` over ``trainer_ranks``, each
    engine generating up to ``tokens_per_step`` tokens a step (None: not known, the size alone decides)."""
    parameters = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    on_cpu = not torch.cuda.is_available()
    if importlib.util.find_spec("vllm") is None:
        return "builtin", "vLLM is not installed"
    if placement == "colocated" and trainer_ranks > 1:
        return "builtin", f"vLLM colocated runs on one trainer rank only ({trainer_ranks} here)"
    if on_cpu and head_dim is not None and head_dim < MIN_CPU_HEAD_DIM:
        return "builtin", f"vLLM's CPU attention refuses head_dim {head_dim}"
    if parameters < VLLM_MIN_PARAMETERS:
        return "builtin", (f"{parameters / 1e6:.1f}M parameters < {VLLM_MIN_PARAMETERS / 1e6:.0f}M: vLLM's per-step "
                           "overhead outweighs its kernels at this size")
    if on_cpu and tokens_per_step is not None and tokens_per_step < VLLM_CPU_MIN_TOKENS_PER_STEP:
        return "builtin", (f"at most {tokens_per_step} generated tokens per step per engine < "
                           f"{VLLM_CPU_MIN_TOKENS_PER_STEP}: on CPU, loading each step's weights into vLLM costs "
                           "more than its faster decoding saves")
    more = f", {tokens_per_step} tokens per step per engine" if on_cpu and tokens_per_step is not None else ""
    return "vllm", f"{parameters / 1e6:.0f}M parameters >= {VLLM_MIN_PARAMETERS / 1e6:.0f}M{more}: vLLM's kernels win"


@dataclass(frozen=True)
class EngineChoice:
    """The engine a run generates with: ``rollout.engine`` as configured, ``auto`` decided, and why."""

    name: str  # "builtin" | "vllm"
    why: str
    configured: str  # rollout.engine as written ("auto" where decided here)

    @property
    def decided(self) -> bool:
        return self.configured == "auto"


def decide_engine(cfg: Any, model: torch.nn.Module, world_size: int) -> EngineChoice:
    """The one decision of ``rollout.engine`` for a run: the trainer (for its engine and for
    ``trainer.precision=auto``'s reasoning) and every standalone worker call it with the same inputs (the
    config, the model as loaded, the world's size: colocated, every rank is a trainer rank), so they cannot
    differ. The answer is kept where it is used, never written back into the config."""
    configured = cfg.rollout.engine
    if configured != "auto":
        return EngineChoice(configured, "as configured", configured)
    name, why = choose_engine(model, cfg.rollout.placement, world_size, generated_tokens_per_engine(cfg))
    return EngineChoice(name, why, configured)
