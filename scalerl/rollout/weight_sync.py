"""Bringing the weights that generate up to date after an update: one interface, a strategy per placement.

``WeightSync.sync() -> metrics`` runs on every trainer rank after each optimizer step, and once at start
where the generating copy may be stale (a resumed pipeline replica, workers holding the initial weights).
A rollout source holds one and the trainer calls it through the source (`sync_weights`). Every strategy
reports ``comm/weight_sync_bytes``, the bytes that reached generating copies on this rank's behalf:

- `SharedWeights`: the engine generates with the trained parameters themselves (the built-in engine,
  colocated): nothing moves;
- `RefreshEngineLayout`: the same, with the built-in engine's decode layout (packed, maybe bf16) rewritten
  from the parameters (0.5B-shaped: see docs/performance.md for its cost);
- `ReplicaRefresh`: pipeline ranks train stages and generate on a full replica, refreshed from the stages
  (`PipelineRunner.refresh_replica`, which counts its broadcasts and gathers as ``weight_sync``);
- `LoadIntoEngine`: a colocated engine with a copy of its own (vLLM) loads the policy's tensors by name;
- `PushToWorkers`: standalone rollout workers receive bucketed, verified deltas from the `WeightSender`
  (`scalerl.comm.weights`), plus ``weight_sync/*`` metrics of the push; each step of the push has the limit
  ``weight_sync.timeout_s`` (the workers joining it, after the requests queued before it, has
  ``trainer.dist_timeout_s``), and one that overruns raises `WeightSyncStalled` naming the side and the bucket;
- `BackgroundPush`: the same push from a snapshot taken after the optimizer step, sent by a background
  thread so the next step does not wait for it (`weight_sync.background`, with ``rollout.staleness >= 1``).

With LoRA adapters the base never changes, so what moves is smaller: workers hold the same base and the same
adapted modules (`scalerl.rollout.worker.worker`), so a push carries the adapters alone (`synced_tensors`: a few MB
where the whole model is GBs) through the same verified delta protocol; an engine with weights of its own
(vLLM) gets the merged weights of the adapted modules only (`merged_adapted_weights`), never the frozen rest.

The last two read ``policy.model``, so they first run the local strategy that brings it up to date (a
pipeline's replica is what gets loaded or pushed). verl's checkpoint engine is the model: one seam between
trainer and rollout, the transport behind it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from scalerl.comm.weights.channel import BroadcastChannel
from scalerl.comm.weights.sender import SyncReport, WeightSender
from scalerl.comm.weights.watchdog import collective_limit_s
from scalerl.models.lora import (
    adapter_parameters,
    has_lora,
    is_adapter_name,
    merged_adapted_weights,
)
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.parallelize import ModelParts, PipelineParts
from scalerl.rollout.engines.engine import RolloutEngine
from scalerl.rollout.engines.weight_loading import WeightLoadingEngine
from scalerl.rollout.worker.protocol import WorkerDriver

BYTES = "comm/weight_sync_bytes"
EXPOSED = "timing_s/weight_sync_exposed"  # what the trainer's step spent on the sync


class WeightSync(Protocol):
    def sync(self) -> dict[str, float]:
        """Bring the generating weights up to the trained ones (every trainer rank calls it); the metrics."""
        ...


class SharedWeights:
    """The engine reads the policy's own parameters: nothing to move."""

    def sync(self) -> dict[str, float]:
        return {BYTES: 0.0}


class RefreshEngineLayout:
    """The engine reads the policy's parameters through a decode layout of its own (packed q/k/v and gate/up,
    bf16 copies: `scalerl.models.decode_model`), laid out again after each step; nothing crosses ranks."""

    def __init__(self, engine, local: WeightSync):
        self.engine, self.local = engine, local

    def sync(self) -> dict[str, float]:
        metrics = self.local.sync()
        self.engine.refresh_weights()
        return metrics


class ReplicaRefresh:
    """A pipeline's full replica on every pipeline rank, refreshed from the stages."""

    def __init__(self, policy: PipelineParts):
        self.policy = policy

    def sync(self) -> dict[str, float]:
        return {BYTES: float(self.policy.refresh_generation_copy())}


class LoadIntoEngine:
    """A colocated engine holding its own weights: the policy's tensors loaded into it by name."""

    def __init__(self, engine: WeightLoadingEngine, policy: ModelParts, local: WeightSync):
        self.engine, self.policy, self.local = engine, policy, local

    def sync(self) -> dict[str, float]:
        moved = self.local.sync()[BYTES]
        model = self.policy.model
        named = (merged_adapted_weights(model) if has_lora(model)
                 else [(n, p.detach()) for n, p in model.named_parameters()])
        moved += self.engine.load_weights(named)
        return {BYTES: float(moved)}


class PushToWorkers:
    """Standalone workers: a WEIGHTS request to each (rank 0), then the sender's push, which every trainer
    rank joins (gathering a sharded parameter is a collective). Only rank 0 sends, so only it counts bytes."""

    def __init__(self, policy: ModelParts, local: WeightSync, sender: WeightSender, driver: WorkerDriver | None,
                 ctx: DistContext):
        self.policy, self.local, self.sender, self.driver, self.ctx = policy, local, sender, driver, ctx
        self.broadcast = sender.channel  # over rank 0 + every worker

    @classmethod
    def from_config(cls, policy: ModelParts, ctx: DistContext, driver: WorkerDriver | None, rollout_dtype: str,
                    weight_sync_cfg) -> PushToWorkers:
        """Broadcasts from rank 0 over the rollout group (rank 0 + the workers), per ``weight_sync``: each step
        within ``weight_sync.timeout_s``, the workers' joining within the default group's limit
        (``trainer.dist_timeout_s``: they first answer the requests queued before the push)."""
        channel = (BroadcastChannel(ctx.rollout_group, src=0, device=ctx.device, timeout_s=weight_sync_cfg.timeout_s,
                                    join_timeout_s=collective_limit_s(ctx.device))
                   if driver is not None else None)
        sender = WeightSender.from_config(weight_sync_cfg, rollout_dtype, channel)
        return cls(policy, local_weight_sync(policy), sender, driver, ctx)

    def sync(self, version: int = 0) -> dict[str, float]:
        start = time.perf_counter()
        moved = self.local.sync()[BYTES]
        report = self._push(version)
        metrics = self.metrics(report, moved)
        metrics[EXPOSED] = time.perf_counter() - start
        if self.driver is not None:
            self.ctx.comm.add_wait("weight_sync", metrics[EXPOSED])
        return metrics

    def _push(self, version: int) -> SyncReport:
        """Announce and push; a push that fails as a worker turns out dead goes again, to the live ones."""
        dead = len(self.driver.dead) if self.driver is not None else 0
        try:
            if self.driver is not None:
                self.to_live_workers()
                self.driver.announce_weights(version)
            return self.sender.sync(synced_tensors(self.policy.model))
        except RuntimeError as e:
            if self.driver is None or len(self.driver.dead) == dead or not self.driver.workers:
                raise
            print(f"warning: the weight push failed as rollout workers {sorted(self.driver.dead)} died ({e}); "
                  "pushing again to the live workers", file=sys.stderr, flush=True)
            return self._push(version)

    def to_live_workers(self) -> None:
        """After a worker died, the pushes go point to point to the live workers (rank 0 only)."""
        self.sender.channel = self.driver.push_channel(self.broadcast)

    def metrics(self, report: SyncReport, moved: float) -> dict[str, float]:
        """A push's metrics, its bytes counted as ``weight_sync`` traffic (rank 0's)."""
        model = self.policy.model
        metrics = report.metrics()
        metrics["weight_sync/push_s"] = report.seconds
        if has_lora(model):  # what a push of the whole model would carry, beside what the adapters did
            itemsize = self.sender.dtype.itemsize
            metrics["weight_sync/full_model_bytes"] = float(sum(p.numel() * itemsize for n, p in model.named_parameters()
                                                                if not is_adapter_name(n)))
        if self.driver is not None and report.bytes:
            workers = len(self.driver.workers)
            self.ctx.comm.record("weight_sync", "broadcast", report.bytes, workers + 1, dim="rollout_workers")
            moved += report.bytes * workers
        metrics[BYTES] = float(moved)
        return metrics


class BackgroundPush:
    """`PushToWorkers` off the step's critical path. `sync` (every trainer rank, after the optimizer step)
    waits for the previous push, takes a snapshot of the synced tensors (gathered where sharded: a collective
    of the trainer ranks, so it runs here, in the step), announces the sync and hands the snapshot to a
    thread on rank 0, which pushes it while the trainer goes on; it returns the previous push's metrics (a
    step late: the first step reports the push at start) and ``timing_s/weight_sync_exposed``, the seconds
    the step spent here.

    The thread uses only the rollout group (rank 0 + the workers: the sender's broadcasts and acks), its own
    gloo context; the trainer's thread keeps the default group (requests, replies) and the trainer ranks'
    collectives, so the two never share a group. A worker reads WEIGHTS in its request order, so what it
    generates after it uses the new version whenever the push lands."""

    def __init__(self, push: PushToWorkers):
        self.push = push
        self.thread: threading.Thread | None = None
        self.outcome: tuple[SyncReport | None, Exception | None] = (None, None)
        self.moved = 0.0
        self.dead_at_start = 0  # rollout workers dead when the push in flight started

    def sync(self, version: int = 0) -> dict[str, float]:
        start = time.perf_counter()
        finished = self.wait()
        moved = self.push.local.sync()[BYTES]
        tensors = synced_tensors(self.push.policy.model)
        if self.push.driver is None:  # join the gathers, in the sender's order; only rank 0 pushes
            for _, t in tensors:
                _full(t)
            metrics = self.push.metrics(SyncReport(), moved)
        else:
            snapshot = [(n, _full(t).detach().clone()) for n, t in tensors]
            self.dead_at_start = len(self.push.driver.dead)  # before the announcement, which may find one
            self.push.to_live_workers()
            self.push.driver.announce_weights(version)
            self.outcome, self.moved = (None, None), moved
            self.thread = threading.Thread(target=self._run, args=(snapshot,), name="weight-push", daemon=True)
            self.thread.start()
            metrics = finished if finished is not None else self.push.metrics(SyncReport(), 0.0)
        metrics[EXPOSED] = time.perf_counter() - start
        self.push.ctx.comm.add_wait("weight_sync", metrics[EXPOSED])
        return metrics

    def wait(self) -> dict[str, float] | None:
        """Wait for the push in flight; its metrics (None when there was none). Bounded: each step of the push
        has weight_sync.timeout_s (the workers' joining it trainer.dist_timeout_s), after which the thread ends
        with the error (`WeightSyncStalled`, naming the side and the bucket), raised here."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread = None
        report, error = self.outcome
        if error is not None:
            driver = self.push.driver
            if driver is not None and len(driver.dead) > self.dead_at_start:  # a worker died during the push
                print(f"warning: the weight push failed as rollout workers {sorted(driver.dead)} died ({error}); "
                      "this step pushes again to the live workers", file=sys.stderr, flush=True)
                return None
            raise error
        return self.push.metrics(report, self.moved)

    def _run(self, snapshot: list[tuple[str, torch.Tensor]]) -> None:
        try:
            self.outcome = (self.push.sender.sync(snapshot), None)
        except Exception as e:  # re-raised on the trainer's thread by `wait`
            self.outcome = (None, e)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: a gather over its mesh for a sharded one (every rank of it calls this)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def synced_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a push to workers carries: the adapters when ``model`` has LoRA (the base is frozen and the
    workers load the same one), else every parameter."""
    return list(adapter_parameters(model)) if has_lora(model) else list(model.named_parameters())


def local_weight_sync(policy: ModelParts) -> WeightSync:
    """What brings ``policy.model``, the weights generation reads on this rank, up to date."""
    return ReplicaRefresh(policy) if isinstance(policy, PipelineParts) else SharedWeights()


def colocated_weight_sync(engine: RolloutEngine, policy: ModelParts) -> WeightSync:
    """The strategy for an engine on the trainer's own ranks."""
    local = local_weight_sync(policy)
    if not engine.shares_trainer_weights:
        return LoadIntoEngine(engine, policy, local)
    return RefreshEngineLayout(engine, local) if hasattr(engine, "refresh_weights") else local
