"""How a run's global batch and held-out set split over data-parallel ranks, and what a layout requires."""

from __future__ import annotations

from typing import Any

from scalerl.parallel.distributed import DistContext
from scalerl.parallel.mesh import LayoutError


def shard_rows(rows: list, ctx: DistContext) -> list:
    """This DP rank's contiguous share of ``rows`` (TP/PP peers get the same share). A remainder that
    does not split evenly is dropped: every rank must run the same number of generation calls."""
    if ctx.dp_size == 1:
        return rows
    per_rank = len(rows) // ctx.dp_size
    return rows[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank]


def check_distributed_config(cfg: Any, ctx: DistContext) -> None:
    """Batch sizes must split evenly over DP ranks; features not yet distributed fail here, by name."""
    if ctx.world_size == 1:
        return
    dp = ctx.dp_size
    problems = []
    if cfg.trainer.batch_size % dp:
        problems.append(f"trainer.batch_size ({cfg.trainer.batch_size}) must be divisible by the data-parallel size {dp}")
    if cfg.actor.ppo_mini_batch_size % dp:
        problems.append(
            f"actor.ppo_mini_batch_size ({cfg.actor.ppo_mini_batch_size}) must be divisible by the data-parallel size {dp}"
        )
    if cfg.sft.batch_size % dp:
        problems.append(f"sft.batch_size ({cfg.sft.batch_size}) must be divisible by the data-parallel size {dp}")
    if ctx.dims.pp > 1 and ctx.dims.tp > 1 and ctx.dims.dp > 1:
        problems.append(
            f"pipeline parallel combines with data parallel or tensor parallel, not both yet "
            f"(pp={ctx.dims.pp}, dp={ctx.dims.dp}, tp={ctx.dims.tp})"
        )
    if ctx.dims.pp > 1:
        local = cfg.actor.ppo_mini_batch_size // dp
        if local % cfg.parallel.microbatches:
            problems.append(
                f"parallel.microbatches ({cfg.parallel.microbatches}) must divide the per-rank mini-batch "
                f"actor.ppo_mini_batch_size / dp = {local}"
            )
        if (cfg.sft.batch_size // dp) % cfg.parallel.microbatches:
            problems.append(
                f"parallel.microbatches ({cfg.parallel.microbatches}) must divide sft.batch_size / dp = {cfg.sft.batch_size // dp}"
            )
        if cfg.actor.micro_batch_max_tokens:
            problems.append("actor.micro_batch_max_tokens (dynamic batch size) does not apply with parallel.pp > 1")
    if cfg.algorithm.adv_estimator == "gae" and ctx.dims.pp > 1:
        problems.append("algorithm.adv_estimator=gae (a critic) does not run with parallel.pp > 1 yet")
    if cfg.rollout.engine != "builtin":
        problems.append("rollout.engine=vllm is single-process only for now")
    if problems:
        raise LayoutError("; ".join(problems))
