"""What each trainer needs from the parallel layout: batch sizes that split over data-parallel ranks and
pipeline micro-batches, and features that do not run distributed yet. Failing here names the keys."""

from __future__ import annotations

from typing import Any

from scalerl.parallel.distributed import DistContext
from scalerl.parallel.mesh import LayoutError


def _divides(problems: list[str], key: str, value: int, dp: int) -> None:
    if value % dp:
        problems.append(f"{key} ({value}) must be divisible by the data-parallel size {dp}")


def _pipeline_problems(problems: list[str], cfg: Any, ctx: DistContext, key: str, per_rank: int) -> None:
    dims = ctx.dims
    if dims.pp > 1 and dims.tp > 1 and dims.dp > 1:
        problems.append(f"pipeline parallel combines with data parallel or tensor parallel, not both yet "
                        f"(pp={dims.pp}, dp={dims.dp}, tp={dims.tp})")
    if dims.pp > 1 and per_rank % cfg.parallel.microbatches:
        problems.append(f"parallel.microbatches ({cfg.parallel.microbatches}) must divide the per-rank "
                        f"mini-batch {key} / dp = {per_rank}")


def check_rl_layout(cfg: Any, ctx: DistContext) -> None:
    if ctx.world_size == 1:
        return
    dp, problems = ctx.dp_size, []
    _divides(problems, "trainer.batch_size", cfg.trainer.batch_size, dp)
    _divides(problems, "actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size, dp)
    _pipeline_problems(problems, cfg, ctx, "actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size // dp)
    if ctx.dims.pp > 1 and cfg.actor.micro_batch_max_tokens:
        problems.append("actor.micro_batch_max_tokens (dynamic batch size) does not apply with parallel.pp > 1")
    if ctx.dims.pp > 1 and cfg.algorithm.adv_estimator == "gae":
        problems.append("algorithm.adv_estimator=gae (a critic) does not run with parallel.pp > 1 yet")
    if cfg.rollout.engine != "builtin":
        problems.append("rollout.engine=vllm is single-process only for now")
    if problems:
        raise LayoutError("; ".join(problems))


def check_sft_layout(cfg: Any, ctx: DistContext) -> None:
    if ctx.world_size == 1:
        return
    dp, problems = ctx.dp_size, []
    _divides(problems, "sft.batch_size", cfg.sft.batch_size, dp)
    _pipeline_problems(problems, cfg, ctx, "sft.batch_size", cfg.sft.batch_size // dp)
    if problems:
        raise LayoutError("; ".join(problems))
