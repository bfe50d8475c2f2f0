"""What one RL step did, as the performance metrics report it: token counts and passes (for MFU), then
throughput, step time, MFU per phase and peak memory."""

from __future__ import annotations

import torch

from scalerl.core.device import compute_dtype
from scalerl.models.config import ModelConfig
from scalerl.parallel.distributed import DistContext
from scalerl.perf.memory import max_memory_gb
from scalerl.perf.mfu import RankShare, StepWork, step_mfu
from scalerl.rollout.batch import RolloutBatch


def step_work(batch: RolloutBatch, forward_passes: int, update_passes: int) -> StepWork:
    response_tokens = int(batch.response_mask.sum())
    prompt_tokens = int(batch.attention_mask.sum()) - response_tokens
    return StepWork(prompt_tokens, response_tokens, prompt_tokens / len(batch), response_tokens / len(batch),
                    forward_passes=forward_passes, update_passes=update_passes)


def performance_metrics(work: StepWork, timings: dict[str, float], step_time: float, model_config: ModelConfig,
                        ctx: DistContext, precision: str, param_dtype: str) -> dict[str, float]:
    """``perf/*`` of this rank: tokens, throughput, MFU of its share (``timings``: this step's ``timing_s/*``)."""
    tokens = work.prompt_tokens + work.response_tokens
    seconds = {"step": step_time, "gen": timings.get("timing_s/gen", 0.0),
               "update": timings.get("timing_s/update_actor", 0.0) + timings.get("timing_s/update_critic", 0.0)}
    dtype = compute_dtype(precision, getattr(torch, param_dtype))
    return {
        "perf/total_num_tokens": float(tokens),
        "perf/time_per_step": step_time,
        "perf/throughput": tokens / step_time,
        **step_mfu(model_config, work, seconds, RankShare(ctx.dims.tp, ctx.dims.pp), ctx.device, dtype),
        "perf/max_memory_gb": max_memory_gb(ctx.device),
    }
