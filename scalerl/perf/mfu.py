"""Model FLOPs utilization of one rank: the FLOPs of its share of the step's work over its device's peak
for the precision it computes in.

A rank's share depends on the layout. Tensor parallelism splits every matmul over ``tp`` ranks; pipeline
parallelism splits the trained layers over ``pp`` stages, but every pipeline rank generates (and computes
log-probs) with a full replica, so generation is divided by ``tp`` only. Data parallelism splits the batch,
which the token counts (this rank's share of the batch) already reflect. The peak is the tensor-core
peak of the training precision (bf16/fp16 under autocast), fp32 otherwise; on a CPU it is measured per
dtype, so a bf16 run on AVX-512 BF16 / AMX is read against the bf16 matmul speed, not fp32's (which hides
that headroom: 4x on an AVX-512 BF16 EPYC core).

Reported per step: ``perf/mfu`` (all the step's FLOPs over the step's time), ``perf/mfu/gen`` (generation
over generation time) and ``perf/mfu/update`` (forward + backward of the update over its time). FLOPs are
useful work only: real tokens, not padding. A critic is counted as one more pass of the policy's size.
Where the rest of the peak went, slice by slice, is `scalerl.perf.mfu_waterfall`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scalerl.models.config import ModelConfig
from scalerl.perf.flops import (
    device_peak_flops,
    flops_per_token,
    forward_flops_per_token,
)


@dataclass(frozen=True)
class RankShare:
    """The fractions of a phase's FLOPs one rank computes, from the tensor and pipeline degrees."""

    tp: int = 1
    pp: int = 1

    @property
    def training(self) -> float:
        return 1.0 / (self.tp * self.pp)

    @property
    def replica(self) -> float:
        """Generation and forward-only passes, which run on a full (tensor-parallel) model on every rank."""
        return 1.0 / self.tp


@dataclass(frozen=True)
class StepWork:
    """What this rank's share of the batch held, and how many passes went over it."""

    prompt_tokens: int
    response_tokens: int
    mean_prompt_len: float
    mean_response_len: float
    forward_passes: int = 0  # forward-only passes over prompt + response (old log-probs, reference, values)
    update_passes: int = 1  # forward + backward passes (ppo_epochs x trained models)


def generation_flops(cfg: ModelConfig, work: StepWork) -> float:
    """Prefill over the prompts plus decoding, each new token attending over half the response on average."""
    prefill = work.prompt_tokens * forward_flops_per_token(cfg, work.mean_prompt_len)
    decode = work.response_tokens * forward_flops_per_token(cfg, work.mean_prompt_len + work.mean_response_len / 2)
    return prefill + decode


def step_mfu(
    cfg: ModelConfig,
    work: StepWork,
    seconds: dict[str, float],
    share: RankShare,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """``perf/mfu``, ``perf/mfu/gen``, ``perf/mfu/update`` from ``seconds`` keyed ``step``, ``gen``, ``update``
    (a phase without time is left out)."""
    tokens = work.prompt_tokens + work.response_tokens
    seq_len = work.mean_prompt_len + work.mean_response_len
    gen = generation_flops(cfg, work) * share.replica
    forward = work.forward_passes * tokens * forward_flops_per_token(cfg, seq_len) * share.replica
    update = work.update_passes * tokens * flops_per_token(cfg, seq_len) * share.training
    peak = device_peak_flops(device, dtype)
    out = {}
    for key, flops, phase in (("perf/mfu", gen + forward + update, "step"), ("perf/mfu/gen", gen, "gen"),
                              ("perf/mfu/update", update, "update")):
        if seconds.get(phase, 0) > 0:
            out[key] = flops / seconds[phase] / peak
    return out
