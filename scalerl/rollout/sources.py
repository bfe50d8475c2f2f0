"""Where a step's rollouts come from: the trainer's own ranks (colocated) or standalone rollout workers.

Both give the trainer the same thing, this data-parallel rank's share of the step's generation output,
and both hold the weight sync that brings the generating weights up to date after the update
(`sync_weights`, a `scalerl.rollout.weight_sync` strategy), so the trainer's step reads the same either way:

- `ColocatedRollouts`: each DP rank generates its share with the engine that shares the policy's weights
  (a pipeline's replica is refreshed from the stages);
- `StandaloneRollouts`: the trainer's rank 0 splits the whole step's prompts over the workers by token
  count (contiguous rows, so per-row random draws do not depend on the split), collects their outputs,
  and every trainer rank receives them and keeps its share; new weights are pushed to every worker. With
  ``rollout.staleness=1`` the next step's prompts go out before the update (`prefetch`), so generation
  overlaps it; `collect_prefetched` receives them after the update and before the weights go out (the
  workers serve requests in order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from scalerl.comm.weights.sender import ROLLOUT_DTYPES
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.parallelize import ModelParts
from scalerl.rollout.engine import (
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    left_pad,
)
from scalerl.rollout.weight_sync import PushToWorkers, WeightSync, colocated_weight_sync
from scalerl.rollout.worker_protocol import WorkerDriver, broadcast_output

# Pipeline ranks split a generation only when each gets at least this many
# rows: fewer, and the exchange and the lockstep finish votes cost more than the decode steps save
# (`benchmarks/pipeline_generation.py`, 2-core CPU: 8 rows per rank 0.90-0.93x, 16 rows 1.03-1.06x, 32 rows
# 1.07-1.30x, 64 rows 1.39-1.42x faster). The cost model (`scalerl.bench.cost_model.step_traffic`) imports it.
MIN_ROWS_PER_PIPELINE_RANK = 16


@dataclass
class StepPrompts:
    """A step's whole batch: every rank draws it and keeps its share."""

    step: int
    prompts: list[list[int]]  # n samples of each prompt, in row order
    sampling: SamplingParams  # for the whole batch (row_offset 0, total_rows = len(prompts))
    rows: list[dict]  # the batch's data rows (prompt, ground truth), one per prompt


def token_split(lengths: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges, one per part, each cut where the running token sum crosses
    the next multiple of total / parts (every part keeps at least one row)."""
    n = len(lengths)
    if n < parts:
        raise ValueError(f"{n} rows cannot be split over {parts} rollout workers; use fewer rollout.workers")
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + length)
    bounds = [0]
    for i in range(1, parts):
        cut = next(j for j in range(n + 1) if prefix[j] >= prefix[-1] * i / parts)
        bounds.append(min(max(cut, bounds[-1] + 1), n - (parts - i)))
    bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:]))


class ColocatedRollouts:
    def __init__(self, engine: RolloutEngine, policy: ModelParts, ctx: DistContext):
        self.engine, self.policy, self.ctx = engine, policy, ctx
        self.weight_sync: WeightSync = colocated_weight_sync(engine, policy)

    @property
    def logprobs_match_training_forward(self) -> bool:
        return self.engine.logprobs_match_training_forward

    def generate(self, batch: StepPrompts) -> GenerationOutput:
        start, stop = _dp_rows(len(batch.prompts), self.ctx)
        pp = self.ctx.dims.pp
        if pp > 1 and stop - start >= MIN_ROWS_PER_PIPELINE_RANK * pp:
            return self._generate_over_pipeline(batch, start, stop)
        sampling = replace(batch.sampling, row_offset=start, total_rows=len(batch.prompts))
        out = self.engine.generate(batch.prompts[start:stop], sampling)
        getattr(self.engine, "sleep", lambda: None)()  # vLLM on a GPU gives its memory to the update
        return out

    def _generate_over_pipeline(self, batch: StepPrompts, start: int, stop: int) -> GenerationOutput:
        """Every pipeline rank holds a full replica: each generates 1/pp of the DP share's rows (per-row
        samples are tied to global rows, so the split changes no sample) and the pipeline group exchanges
        them, so every stage gets the whole share without generating it pp times (from
        `MIN_ROWS_PER_PIPELINE_RANK` rows per rank; below that every rank generates the whole share)."""
        mesh = self.ctx.mesh["pp"]
        group, index = mesh.get_group(), mesh.get_local_rank()
        ranks = dist.get_process_group_ranks(group)
        bounds = [start + (stop - start) * i // len(ranks) for i in range(len(ranks) + 1)]
        lo, hi = bounds[index], bounds[index + 1]
        sampling = replace(batch.sampling, row_offset=lo, total_rows=len(batch.prompts))
        mine = self.engine.generate(batch.prompts[lo:hi], sampling)
        parts = []
        for i, src in enumerate(ranks):  # every rank joins every broadcast, sending its own
            shared = broadcast_output(mine if i == index else None, src, group, self.ctx)
            parts.append(mine if i == index else shared)
        return GenerationOutput.concat(parts, self.engine.pad_token_id)

    def prefetch(self, batch: StepPrompts | None) -> None:
        """Colocated generation uses the latest weights: nothing runs ahead."""

    def collect_prefetched(self) -> None:
        """Nothing was prefetched."""

    def sync_weights(self) -> dict[str, float]:
        return self.weight_sync.sync()

    def close(self) -> None:
        pass


class StandaloneRollouts:
    def __init__(self, policy: ModelParts, ctx: DistContext, pad_token_id: int, rollout_cfg, weight_sync_cfg):
        self.policy, self.ctx, self.pad_token_id = policy, ctx, pad_token_id
        self.dtype, self.staleness = ROLLOUT_DTYPES[rollout_cfg.dtype], rollout_cfg.staleness
        self.behavior_logprobs = rollout_cfg.stale_logprobs == "behavior"
        self.exact_engine = getattr(rollout_cfg, "engine", "builtin") == "builtin"  # vLLM's kernels differ
        self.driver = WorkerDriver(ctx) if ctx.rank == 0 else None  # rank 0 talks to the workers
        self.weight_sync: WeightSync = PushToWorkers.from_config(policy, ctx, self.driver, rollout_cfg.dtype,
                                                                 weight_sync_cfg)
        self.pending: StepPrompts | None = None  # submitted, not collected yet
        self.ready: tuple[int, GenerationOutput] | None = None  # collected ahead of its step

    @property
    def logprobs_match_training_forward(self) -> bool:
        """fp32 built-in workers compute what the trainer's fp32 forward does: of the latest weights, or, one step stale
        with rollout.stale_logprobs=behavior, of the behaviour policy PPO then takes its ratio against."""
        return self.exact_engine and self.dtype == torch.float32 and (not self.staleness or self.behavior_logprobs)

    def generate(self, batch: StepPrompts) -> GenerationOutput:
        if self.ready is not None and self.ready[0] == batch.step:
            out, self.ready = self.ready[1], None
        else:
            self._submit(batch)
            out = self._collect()
        start, stop = _dp_rows(len(batch.prompts), self.ctx)
        return out.rows(start, stop)

    def prefetch(self, batch: StepPrompts | None) -> None:
        """With staleness 1, send the next step's prompts now: the workers generate them with the weights
        they hold (this step's) while the trainer updates."""
        if self.staleness and batch is not None:
            self._submit(batch)

    def collect_prefetched(self) -> None:
        """Receive the prefetched step's rollouts (kept for its `generate`): after the update, before the
        weights go out, since the workers answer requests in the order they came."""
        if self.pending is not None:
            step = self.pending.step
            self.ready = (step, self._collect())

    def sync_weights(self) -> dict[str, float]:
        """Push the new weights to every worker (lossless deltas, verified per bucket: see
        `scalerl.rollout.weight_sync.PushToWorkers`); returns the sync's metrics."""
        if self.pending is not None:
            raise RuntimeError(f"step {self.pending.step}'s prefetched rollouts were not collected: call "
                               "collect_prefetched() before sync_weights() (the workers answer in order)")
        return self.weight_sync.sync()

    def close(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    def _submit(self, batch: StepPrompts) -> None:
        self.pending = batch
        if self.driver is None:
            return
        lengths = [len(p) + batch.sampling.max_new_tokens for p in batch.prompts]  # the work each row may cost
        for worker, (start, stop) in zip(self.driver.workers, token_split(lengths, len(self.driver.workers))):
            prompts = batch.prompts[start:stop]
            ids, mask = left_pad(prompts, self.pad_token_id)
            sampling = replace(batch.sampling, row_offset=start, total_rows=len(batch.prompts))
            self.driver.request_generation(worker, batch.step, sampling, ids, mask.sum(-1))

    def _collect(self) -> GenerationOutput:
        """The whole batch's output on every trainer rank (rank 0 receives it from the workers)."""
        out = None
        if self.driver is not None:
            out = GenerationOutput.concat(self.driver.receive_outputs(), self.pad_token_id)
        self.pending = None
        if self.ctx.world_size > 1:
            out = broadcast_output(out, 0, self.ctx.group, self.ctx)
        return out


def _dp_rows(total: int, ctx: DistContext) -> tuple[int, int]:
    per = total // ctx.dp_size
    return ctx.dp_rank * per, (ctx.dp_rank + 1) * per
