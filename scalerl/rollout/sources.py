"""Where a step's rollouts come from: the trainer's own ranks (colocated) or standalone rollout workers.

Both give the trainer the same thing, this data-parallel rank's share of the step's generation output,
and both bring the generating weights up to date after the update (`sync_weights`), so the trainer's step
reads the same either way:

- `ColocatedRollouts`: each DP rank generates its share with the engine that shares the policy's weights
  (a pipeline's replica is refreshed from the stages);
- `StandaloneRollouts`: the trainer's rank 0 splits the whole step's prompts over the workers by token
  count (contiguous rows, so per-row random draws do not depend on the split), collects their outputs,
  and every trainer rank receives them and keeps its share; new weights are pushed to every worker. With
  ``rollout.staleness=1`` the next step's prompts go out before the update, so generation overlaps it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from scalerl.comm.weights.channel import BroadcastChannel
from scalerl.comm.weights.sender import ROLLOUT_DTYPES, WeightSender
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.parallelize import ModelParts
from scalerl.rollout.engine import (
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    left_pad,
)
from scalerl.rollout.messages import broadcast_tensors, recv_tensors, send_tensors
from scalerl.rollout.worker import (
    OP_STOP,
    OP_WEIGHTS,
    decode_output,
    encode_output,
    encode_request,
)

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

    @property
    def logprobs_match_training_forward(self) -> bool:
        return self.engine.logprobs_match_training_forward

    def generate(self, batch: StepPrompts) -> GenerationOutput:
        start, stop = _dp_rows(len(batch.prompts), self.ctx)
        pp = self.ctx.dims.pp
        if pp > 1 and stop - start >= MIN_ROWS_PER_PIPELINE_RANK * pp:
            return self._generate_over_pipeline(batch, start, stop)
        sampling = replace(batch.sampling, row_offset=start, total_rows=len(batch.prompts))
        return self.engine.generate(batch.prompts[start:stop], sampling)

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
        parts = [mine if i == index else None for i in range(len(ranks))]
        for i, src in enumerate(ranks):
            message = broadcast_counted(encode_output(mine) if i == index else None, src, group, self.ctx)
            if i != index:
                parts[i] = decode_output(message)
        return GenerationOutput.concat(parts, self.engine.pad_token_id)

    def prefetch(self, batch: StepPrompts | None) -> None:
        """Colocated generation uses the latest weights: nothing runs ahead."""

    def sync_weights(self) -> dict[str, float]:
        moved = self.policy.refresh_generation_copy()
        if not self.engine.shares_trainer_weights:
            moved += self.engine.sync_weights({n: p.detach() for n, p in self.policy.model.named_parameters()})
        return {"comm/weight_sync_bytes": float(moved)}

    def close(self) -> None:
        pass


class StandaloneRollouts:
    def __init__(self, policy: ModelParts, ctx: DistContext, pad_token_id: int, rollout_cfg, weight_sync_cfg):
        self.policy, self.ctx, self.pad_token_id = policy, ctx, pad_token_id
        self.dtype, self.staleness = ROLLOUT_DTYPES[rollout_cfg.dtype], rollout_cfg.staleness
        self.behavior_logprobs = rollout_cfg.stale_logprobs == "behavior"
        channel = BroadcastChannel(ctx.rollout_group, src=0, device=ctx.device) if ctx.rank == 0 else None
        self.sender = WeightSender.from_config(weight_sync_cfg, rollout_cfg.dtype, channel)
        self.pending: StepPrompts | None = None  # submitted, not collected yet
        self.ready: tuple[int, GenerationOutput] | None = None  # collected ahead of its step

    @property
    def logprobs_match_training_forward(self) -> bool:
        """fp32 workers compute what the trainer's fp32 forward does: of the latest weights, or, one step stale
        with rollout.stale_logprobs=behavior, of the behaviour policy PPO then takes its ratio against."""
        return self.dtype == torch.float32 and (not self.staleness or self.behavior_logprobs)

    @property
    def _driver(self) -> bool:
        return self.ctx.rank == 0

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

    def sync_weights(self) -> dict[str, float]:
        """Collect the prefetched step first (the workers serve requests in order), then push the new
        weights to every worker with the weight sender (lossless deltas, verified per bucket: see
        `scalerl.comm.weights.sender`); returns the sync's metrics."""
        if self.pending is not None:
            step = self.pending.step
            self.ready = (step, self._collect())
        moved = self.policy.refresh_generation_copy()  # a pipeline's replica is what gets sent
        if self._driver:
            for worker in self.ctx.rollout_ranks:
                self._send("weight_sync", [torch.tensor([OP_WEIGHTS, 0])], worker)
        start = time.perf_counter()
        report = self.sender.sync(self.policy.model.named_parameters())  # every trainer rank joins the gathers
        metrics = report.metrics()
        if self._driver:
            workers = len(self.ctx.rollout_ranks)
            self.ctx.comm.record("weight_sync", "broadcast", report.bytes, workers + 1, dim="rollout_workers")
            self.ctx.comm.add_wait("weight_sync", time.perf_counter() - start)
            moved += report.bytes * workers
        metrics["comm/weight_sync_bytes"] = float(moved)
        return metrics

    def _send(self, kind: str, tensors: list[torch.Tensor], worker: int) -> int:
        """`send_tensors`, counted (a point-to-point send of its payload) and timed."""
        start = time.perf_counter()
        sent = send_tensors(tensors, worker, device=self.ctx.device)
        self.ctx.comm.record(kind, "send", sent, 2, dim="rollout_workers")
        self.ctx.comm.add_wait(kind, time.perf_counter() - start)
        return sent

    def close(self) -> None:
        if self._driver:
            for worker in self.ctx.rollout_ranks:
                self._send("rollout", [torch.tensor([OP_STOP, 0])], worker)

    def _submit(self, batch: StepPrompts) -> None:
        self.pending = batch
        if not self._driver:
            return
        lengths = [len(p) + batch.sampling.max_new_tokens for p in batch.prompts]  # the work each row may cost
        for worker, (start, stop) in zip(self.ctx.rollout_ranks, token_split(lengths, len(self.ctx.rollout_ranks))):
            prompts = batch.prompts[start:stop]
            ids, mask = left_pad(prompts, self.pad_token_id)
            sampling = replace(batch.sampling, row_offset=start, total_rows=len(batch.prompts))
            self._send("rollout", encode_request(batch.step, sampling, ids, mask.sum(-1)), worker)

    def _collect(self) -> GenerationOutput:
        """The whole batch's output on every trainer rank (rank 0 receives it from the workers)."""
        message = None
        if self._driver:
            parts = [decode_output(recv_tensors(worker, device=self.ctx.device)) for worker in self.ctx.rollout_ranks]
            message = encode_output(GenerationOutput.concat(parts, self.pad_token_id))
        self.pending = None
        if self.ctx.world_size > 1:
            message = broadcast_counted(message, 0, self.ctx.group, self.ctx)
        return decode_output(message)


def broadcast_counted(message: list[torch.Tensor] | None, src: int, group, ctx: DistContext) -> list[torch.Tensor]:
    """`broadcast_tensors` from global rank ``src`` over ``group``, counted as ``rollout`` traffic and timed."""
    start = time.perf_counter()
    message = broadcast_tensors(message, src=src, group=group, device=ctx.device)
    # one broadcast per tensor after the header's length and the header (int64: count, then per tensor
    # dtype, ndim, sizes): counted as one payload
    header = 8 * (2 + sum(2 + t.dim() for t in message))
    payload = header + sum(t.numel() * t.element_size() for t in message)
    size = dist.get_world_size(group) if group is not None else ctx.world_size
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    ctx.comm.record("rollout", "broadcast", payload, size, group_rank=ranks.index(ctx.rank), root=ranks.index(src))
    ctx.comm.add_wait("rollout", time.perf_counter() - start)
    return message


def _dp_rows(total: int, ctx: DistContext) -> tuple[int, int]:
    per = total // ctx.dp_size
    return ctx.dp_rank * per, (ctx.dp_rank + 1) * per
