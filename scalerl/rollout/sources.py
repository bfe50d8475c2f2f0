"""Where a step's rollouts come from: the trainer's own ranks (colocated) or standalone rollout workers.

Both give the trainer the same thing, this data-parallel rank's share of the step's generation output,
and both hold the weight sync that brings the generating weights up to date after the update
(`sync_weights`, a `scalerl.rollout.weight_sync` strategy), so the trainer's step reads the same either way:

- `ColocatedRollouts`: each DP rank generates its share with the engine that shares the policy's weights
  (a pipeline's replica is refreshed from the stages);
- `StandaloneRollouts`: the trainer's rank 0 splits the whole step's prompts into one part per worker by
  token count (contiguous rows, so per-row random draws do not depend on the split), sends each part to
  the worker with the fewest tokens in flight, collects their outputs, and every trainer rank receives them
  and keeps its share; new weights are pushed to every worker. Parts are whole prompt groups
  (`token_split`), so with ``rollout.stream_groups`` the trainer takes each part as it arrives
  (`generate_parts`: rank 0 receives it and broadcasts it to the other trainer ranks) and works on it while
  the other workers still generate. In an agent run (rollout.agent.env) each part's data rows go with its
  prompts, the workers run the episodes, and their ``agent/*`` metrics come back with the replies. With
  ``rollout.staleness=K``
  the prompts of up to K later steps are in flight while a step trains (`prefetch`); the workers answer in
  request order, and a step's outputs are collected when the trainer reaches it, so a request sent after
  the push of version v is generated with v, whatever the timing. `step_metrics` reports the trainer's wait for
  rollouts (``timing_s/trainer_idle``), the workers' wait for requests or weights (``timing_s/rollout_idle``,
  the mean over live workers, as they report it) and how many workers died (``rollout/dead_workers``, the
  latest one's rank ``rollout/last_dead_worker``, -1 for none: their requests went again to the live ones).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from scalerl.core.device import PRECISION_DTYPES
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.parallelize import ModelParts
from scalerl.perf.metrics import reduction_of
from scalerl.rollout.engines.engine import (
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    left_pad,
)
from scalerl.rollout.weight_sync import (
    BackgroundPush,
    PushToWorkers,
    WeightSync,
    colocated_weight_sync,
)
from scalerl.rollout.worker.messages import broadcast_tensors
from scalerl.rollout.worker.protocol import (
    WorkerDriver,
    broadcast_output,
    from_json_tensor,
    json_tensor,
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


def token_split(lengths: list[int], parts: int, group_size: int = 1) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges, one per part, each cut where the running token sum crosses
    the next multiple of total / parts (every part keeps at least one group). Cuts fall between groups of
    ``group_size`` rows (a prompt's ``rollout.n`` samples), so each part is a set of whole groups: the trainer
    can score a part and compute its per-group advantages as soon as it arrives."""
    n = len(lengths)
    if n % group_size:
        raise ValueError(f"{n} rows are not whole groups of {group_size} samples")
    groups = n // group_size
    if groups < parts:
        raise ValueError(f"{groups} prompt groups cannot be split over {parts} rollout workers (a group's "
                         "samples stay on one worker); use fewer rollout.workers or a larger trainer.batch_size")
    prefix = [0]
    for g in range(groups):
        prefix.append(prefix[-1] + sum(lengths[g * group_size : (g + 1) * group_size]))
    bounds = [0]
    for i in range(1, parts):
        cut = next(j for j in range(groups + 1) if prefix[j] >= prefix[-1] * i / parts)
        bounds.append(min(max(cut, bounds[-1] + 1), groups - (parts - i)))
    bounds.append(groups)
    return [(a * group_size, b * group_size) for a, b in zip(bounds[:-1], bounds[1:])]


class ColocatedRollouts:
    def __init__(self, engine: RolloutEngine, policy: ModelParts, ctx: DistContext):
        self.engine, self.policy, self.ctx = engine, policy, ctx
        self.weight_sync: WeightSync = colocated_weight_sync(engine, policy)
        # `cut_into`: this rank's rows generated in several parts of whole groups (a judge pool scores each
        # while the next generates); 1 = the whole share in one generation.
        self.split_parts, self.group_size = 1, 1

    def cut_into(self, parts: int, group_size: int) -> None:
        """Generate this rank's rows in ``parts`` parts of whole groups of ``group_size`` rows (each row's
        sample depends only on its global row, so the samples are those of one generation)."""
        self.split_parts, self.group_size = max(1, parts), max(1, group_size)

    @property
    def logprobs_match_training_forward(self) -> bool:
        return self.engine.logprobs_match_training_forward

    def generate(self, batch: StepPrompts) -> GenerationOutput:
        start, stop = dp_rows(len(batch.prompts), self.ctx)
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

    def parts(self, batch: StepPrompts) -> Iterator[tuple[int, GenerationOutput, bool]]:
        """This DP rank's rows of ``batch`` as one part: ``(its first row in the step, output, last=True)``, or
        as `cut_into` parts (``last`` on the final one)."""
        start, stop = dp_rows(len(batch.prompts), self.ctx)
        groups = (stop - start) // self.group_size
        parts = min(self.split_parts, groups)
        if parts <= 1 or self.ctx.dims.pp > 1 or (stop - start) % self.group_size:
            yield start, self.generate(batch), True
            return
        bounds = [start + self.group_size * (groups * i // parts) for i in range(parts + 1)]
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            sampling = replace(batch.sampling, row_offset=lo, total_rows=len(batch.prompts))
            out = self.engine.generate(batch.prompts[lo:hi], sampling)
            if i == parts - 1:
                getattr(self.engine, "sleep", lambda: None)()  # vLLM on a GPU gives its memory to the update
            yield lo, out, i == parts - 1

    def prefetch(self, batch: StepPrompts | None) -> None:
        """Colocated generation uses the latest weights: nothing runs ahead."""

    def sync_weights(self, version: int = 0) -> dict[str, float]:
        return self.weight_sync.sync()

    def step_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def workers_compute_dtype(rollout_dtype: str, precision: str) -> torch.dtype:
    """What built-in rollout workers decode in: bf16 over their fp32 copy (``rollout.dtype=fp32``) under an
    explicit ``trainer.precision=bf16``, the training forward's recipe; else their copy's dtype. (Under
    ``auto`` the trainer resolves the precision after the workers started: they keep their copy's.)"""
    if rollout_dtype == "fp32" and precision == "bf16":
        return torch.bfloat16
    return PRECISION_DTYPES[rollout_dtype]


class StandaloneRollouts:
    def __init__(self, policy: ModelParts, ctx: DistContext, pad_token_id: int, rollout_cfg, weight_sync_cfg,
                 precision: str = "fp32", training_dtype: torch.dtype | None = torch.float32, engine: str = "builtin"):
        self.policy, self.ctx, self.pad_token_id = policy, ctx, pad_token_id
        self.dtype, self.staleness = PRECISION_DTYPES[rollout_cfg.dtype], rollout_cfg.staleness
        # ``precision`` as configured (the workers read it so); ``training_dtype``: the compute dtype of the
        # trainer's forward where a built-in engine on the trainer's model would match it, else None.
        self.compute_dtype, self.training_dtype = workers_compute_dtype(rollout_cfg.dtype, precision), training_dtype
        self.behavior_logprobs = rollout_cfg.stale_logprobs == "behavior"
        self.group_size = rollout_cfg.n  # a step's parts are whole groups of n samples (`token_split`)
        self.stream_groups = bool(getattr(rollout_cfg, "stream_groups", False))  # each reply a part of its own
        self.exact_engine = engine == "builtin"  # the workers' engine (`decide_engine`); vLLM's kernels differ
        # rollout.agent.env: the workers run episodes, so each part's data rows go with its prompts, and the
        # workers' ``agent/*`` metrics come back with their replies (rows, metrics) until `step_metrics`
        self.agent = bool(getattr(getattr(rollout_cfg, "agent", None), "env", None))
        self.agent_parts: list[tuple[int, dict[str, float]]] = []
        self.driver = WorkerDriver(ctx) if ctx.rank == 0 else None  # rank 0 talks to the workers
        push = PushToWorkers.from_config(policy, ctx, self.driver, rollout_cfg.dtype, weight_sync_cfg)
        # At staleness 0 the next step's generation needs the new weights: the push is on the critical path
        # either way, so it runs in the step.
        background = weight_sync_cfg.background and self.staleness >= 1
        self.weight_sync: WeightSync = BackgroundPush(push) if background else push
        self.in_flight: deque[tuple[StepPrompts, list[tuple[int, int, int]]]] = deque()  # (batch, parts), oldest first
        self.ready: dict[int, GenerationOutput] = {}  # collected, not handed out yet
        self.trainer_idle = self.rollout_idle = 0.0  # seconds since the last `step_metrics`
        self.dead_workers = 0  # workers that stopped answering, their requests re-issued (`WorkerDriver`)
        self.last_dead = -1  # the rank of the latest of them (-1: none)

    @property
    def logprobs_match_training_forward(self) -> bool:
        """Built-in workers over fp32 copies compute what the trainer's forward does (fp32, or bf16 on CPU by
        one recipe: `logprobs_match_forward`): of the latest weights, or, stale with
        rollout.stale_logprobs=behavior, of the behaviour policy PPO then takes its ratio against."""
        same = self.dtype == torch.float32 and self.compute_dtype == self.training_dtype
        if self.agent:  # episodes decode on the continuous engine, whose log-probs match only in fp32
            same = same and self.compute_dtype == torch.float32
        return self.exact_engine and same and (not self.staleness or self.behavior_logprobs)

    def generate(self, batch: StepPrompts) -> GenerationOutput:
        start = time.perf_counter()
        if batch.step not in self.ready and all(b.step != batch.step for b, _ in self.in_flight):
            self._submit(batch)
        while batch.step not in self.ready:
            self._collect_oldest()
        self.trainer_idle += time.perf_counter() - start
        out = self.ready.pop(batch.step)
        start, stop = dp_rows(len(batch.prompts), self.ctx)
        return out.rows(start, stop)

    def parts(self, batch: StepPrompts) -> Iterator[tuple[int, GenerationOutput, bool]]:
        """``batch``'s rows as the trainer takes them, ``(first row in the step, output, whether it is the
        last)``: with rollout.stream_groups each worker's reply as it arrives (`generate_parts`), else this DP
        rank's rows joined, as one part."""
        if self.stream_groups:
            yield from self.generate_parts(batch)
            return
        start, _ = dp_rows(len(batch.prompts), self.ctx)
        yield start, self.generate(batch), True

    def generate_parts(self, batch: StepPrompts) -> Iterator[tuple[int, GenerationOutput, bool]]:
        """``batch``'s parts as each worker's reply arrives, ``(first row, output, whether it is the last)``,
        each a set of whole groups of the whole batch (rollout.stream_groups: the trainer scores a part and
        runs its forward passes while the other workers still generate). Rank 0 receives them; with more than
        one trainer rank it broadcasts each as it comes, so every rank sees the same parts in the same order
        (and keeps its DP share's rows). The waits for replies count as ``timing_s/trainer_idle``."""
        if batch.step not in self.ready and all(b.step != batch.step for b, _ in self.in_flight):
            self._submit(batch)
        while batch.step not in self.ready and self.in_flight[0][0].step != batch.step:
            self._collect_oldest()  # earlier steps sent ahead first, whole, as `generate` does
        if batch.step in self.ready:
            yield 0, self.ready.pop(batch.step), True
            return
        _, parts = self.in_flight.popleft()
        # rank 0 waits for the parts it sent; the other ranks (which sent none) for the part marked last
        waiting, replies, shared, last = {start for _, start, _ in parts}, [], self.ctx.world_size > 1, False
        while not last:
            start = time.perf_counter()
            out, header = None, None
            if self.driver is not None:
                reply = self.driver.collect_first(batch.step, waiting)
                waiting.discard(reply.row_start)
                if reply.metrics:
                    self.agent_parts.append((len(reply.out.finish_reasons), reply.metrics))
                replies.append(reply)
                out, last = reply.out, not waiting
                header = torch.zeros(5, dtype=torch.float64)  # [first row, last, `_workers_record`'s three]
                header[0], header[1] = reply.row_start, float(last)
                if last:
                    header[2:] = self._workers_record(sum(r.idle_s for r in replies) / len(self.driver.workers))
            if shared:
                header = broadcast_tensors([header] if self.ctx.rank == 0 else None, 0, self.ctx.group,
                                           self.ctx.device)[0].cpu()
                out = broadcast_output(out, 0, self.ctx.group, self.ctx)
            self.trainer_idle += time.perf_counter() - start
            row_start, last = int(header[0]), bool(header[1])
            if last:  # the step's worker metrics as `_collect_oldest` takes them, before the last part's work
                self._note_workers(header[2:])
            yield row_start, out, last

    def prefetch(self, batch: StepPrompts | None) -> None:
        """With staleness >= 1, send a later step's prompts now: the workers generate them with the weights
        they hold when they reach them, while the trainer updates."""
        if self.staleness and batch is not None:
            self._submit(batch)

    def sync_weights(self, version: int = 0) -> dict[str, float]:
        """Push the new weights (policy ``version``) to every worker (lossless deltas, verified per bucket:
        see `scalerl.rollout.weight_sync`); returns the sync's metrics."""
        return self.weight_sync.sync(version)

    def step_metrics(self) -> dict[str, float]:
        metrics = {"timing_s/trainer_idle": self.trainer_idle, "timing_s/rollout_idle": self.rollout_idle,
                   "rollout/dead_workers": float(self.dead_workers), "rollout/last_dead_worker": float(self.last_dead)}
        self.trainer_idle = self.rollout_idle = 0.0
        if self.agent:
            metrics.update(self._agent_metrics())
        return metrics

    def _agent_metrics(self) -> dict[str, float]:
        """The workers' ``agent/*`` metrics of the steps collected since the last call, as every trainer rank
        reports them: rank 0 joins the replies' (`join_agent_metrics`) and shares them; each rank reports a
        count as its 1/dp share, so the sum over ranks (`scalerl.perf.metrics`) is the step's count."""
        joined = join_agent_metrics(self.agent_parts)
        self.agent_parts = []
        if self.ctx.world_size > 1:
            keys = sorted(joined)
            names = json_tensor(keys, "agent metric names") if self.ctx.rank == 0 else None
            values = torch.tensor([joined[k] for k in keys], dtype=torch.float64) if self.ctx.rank == 0 else None
            names, values = broadcast_tensors([names, values] if self.ctx.rank == 0 else None, 0, self.ctx.group,
                                              self.ctx.device)
            joined = dict(zip(from_json_tensor(names), values.cpu().tolist()))
        return {k: v / self.ctx.dp_size if reduction_of(k) == "sum" else v for k, v in joined.items()}

    def close(self) -> None:
        if isinstance(self.weight_sync, BackgroundPush):
            self.weight_sync.wait()
        if self.driver is not None:
            self.driver.stop()

    def _submit(self, batch: StepPrompts) -> None:
        """Each worker's part of ``batch``, the largest first, to the least-loaded worker then."""
        parts: list[tuple[int, int, int]] = []  # (worker, start, stop) in the order sent
        if self.driver is not None:
            lengths = [len(p) + batch.sampling.max_new_tokens for p in batch.prompts]  # the work each row may cost
            ranges = token_split(lengths, len(self.driver.workers), self.group_size)
            for start, stop in sorted(ranges, key=lambda r: (-sum(lengths[r[0]:r[1]]), r[0])):
                worker = self.driver.least_loaded()
                ids, mask = left_pad(batch.prompts[start:stop], self.pad_token_id)
                sampling = replace(batch.sampling, row_offset=start, total_rows=len(batch.prompts))
                rows = [batch.rows[i // self.group_size] for i in range(start, stop)] if self.agent else None
                self.driver.request_generation(worker, batch.step, sampling, ids, mask.sum(-1),
                                               tokens=sum(lengths[start:stop]), rows=rows)
                parts.append((worker, start, stop))
        self.in_flight.append((batch, parts))

    def _collect_oldest(self) -> None:
        """The oldest step in flight, whole, on every trainer rank (rank 0 receives its parts from the workers;
        a streaming worker may answer a later part first, which the driver keeps for its turn)."""
        batch, parts = self.in_flight.popleft()
        out, idle = None, torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)  # `_workers_record`'s layout
        if self.driver is not None:
            replies = {start: self.driver.collect(batch.step, start) for _, start, _ in parts}
            self.agent_parts += [(len(r.out.finish_reasons), r.metrics) for r in replies.values() if r.metrics]
            out = GenerationOutput.concat([replies[start].out for start in sorted(replies)], self.pad_token_id)
            idle = self._workers_record(sum(r.idle_s for r in replies.values()) / len(self.driver.workers))
        if self.ctx.world_size > 1:
            out = broadcast_output(out, 0, self.ctx.group, self.ctx)
            idle = broadcast_tensors([idle] if self.ctx.rank == 0 else None, 0, self.ctx.group, self.ctx.device)[0]
        self._note_workers(idle)
        self.ready[batch.step] = out

    def _workers_record(self, idle_s: float) -> torch.Tensor:
        """Rank 0's record of a collected step, as the trainer ranks share it: [workers' idle s, dead workers,
        the rank of the latest dead one (-1: none)]."""
        last_dead = max(self.driver.dead, key=list(self.driver.dead).index, default=-1)
        return torch.tensor([idle_s, len(self.driver.dead), last_dead], dtype=torch.float64)

    def _note_workers(self, record: torch.Tensor) -> None:
        self.rollout_idle += float(record[0])
        self.dead_workers, self.last_dead = int(record[1]), int(record[2])


def join_agent_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """``agent/*`` metrics of several workers' replies (each ``(rows, metrics)``) as one step's: counts
    summed, maxima the largest, means weighted by rows (as `scalerl.perf.metrics` declares each)."""
    rows = sum(n for n, _ in parts)
    out: dict[str, float] = {}
    for key in sorted({k for _, m in parts for k in m}):
        kind, have = reduction_of(key), [(n, m[key]) for n, m in parts if key in m]
        if kind == "max":
            out[key] = max(v for _, v in have)
        elif kind == "sum":
            out[key] = sum(v for _, v in have)
        else:
            out[key] = sum(n * v for n, v in have) / max(sum(n for n, _ in have), 1)
    return out if rows else {}


def dp_rows(total: int, ctx: DistContext) -> tuple[int, int]:
    """This DP rank's rows ``[start, stop)`` of a step's ``total`` (equal shares, in rank order)."""
    per = total // ctx.dp_size
    return ctx.dp_rank * per, (ctx.dp_rank + 1) * per
