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
  (`scalerl.comm.weights`), plus ``weight_sync/*`` metrics of the push.

With LoRA adapters the base never changes, so what moves is smaller: workers hold the same base and the same
adapted modules (`scalerl.rollout.worker`), so a push carries the adapters alone (`synced_tensors`: a few MB
where the whole model is GBs) through the same verified delta protocol; an engine with weights of its own
(vLLM) gets the merged weights of the adapted modules only (`merged_adapted_weights`), never the frozen rest.

The last two read ``policy.model``, so they first run the local strategy that brings it up to date (a
pipeline's replica is what gets loaded or pushed). verl's checkpoint engine is the model: one seam between
trainer and rollout, the transport behind it.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from scalerl.comm.weights.channel import BroadcastChannel
from scalerl.comm.weights.sender import WeightSender
from scalerl.models.lora import (
    adapter_parameters,
    has_lora,
    is_adapter_name,
    merged_adapted_weights,
)
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.parallelize import ModelParts, PipelineParts
from scalerl.rollout.engine import RolloutEngine
from scalerl.rollout.weight_loading import WeightLoadingEngine
from scalerl.rollout.worker_protocol import WorkerDriver

BYTES = "comm/weight_sync_bytes"


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

    @classmethod
    def from_config(cls, policy: ModelParts, ctx: DistContext, driver: WorkerDriver | None, rollout_dtype: str,
                    weight_sync_cfg) -> PushToWorkers:
        """Broadcasts from rank 0 over the rollout group (rank 0 + the workers), per ``weight_sync``."""
        channel = BroadcastChannel(ctx.rollout_group, src=0, device=ctx.device) if driver is not None else None
        sender = WeightSender.from_config(weight_sync_cfg, rollout_dtype, channel)
        return cls(policy, local_weight_sync(policy), sender, driver, ctx)

    def sync(self) -> dict[str, float]:
        moved = self.local.sync()[BYTES]
        if self.driver is not None:
            self.driver.announce_weights()
        start = time.perf_counter()
        model = self.policy.model
        report = self.sender.sync(synced_tensors(model))
        metrics = report.metrics()
        if has_lora(model):  # what a push of the whole model would carry, beside what the adapters did
            itemsize = self.sender.dtype.itemsize
            metrics["weight_sync/full_model_bytes"] = float(sum(p.numel() * itemsize for n, p in model.named_parameters()
                                                                if not is_adapter_name(n)))
        if self.driver is not None:
            workers = len(self.driver.workers)
            self.ctx.comm.record("weight_sync", "broadcast", report.bytes, workers + 1, dim="rollout_workers")
            self.ctx.comm.add_wait("weight_sync", time.perf_counter() - start)
            moved += report.bytes * workers
        metrics[BYTES] = float(moved)
        return metrics


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
