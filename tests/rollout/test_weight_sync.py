"""The weight-sync strategies behind the rollout sources, in one process: which one each placement gets,
the bytes each reports (``comm/weight_sync_bytes``, ``weight_sync/*``), the order of a push (the workers
are told before the buckets go), and the standalone source's two calls after an update (collect the
prefetched rollouts, then push)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from scalerl.comm.counting.accounting import CommCounter, wire_bytes
from scalerl.comm.weights.channel import InProcessChannel
from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
from scalerl.comm.weights.sender import SyncReport, WeightSender
from scalerl.core.config import load_config
from scalerl.parallel.parallelize import PipelineParts
from scalerl.rollout.engine import GenerationOutput, SamplingParams
from scalerl.rollout.sources import StandaloneRollouts, StepPrompts
from scalerl.rollout.weight_sync import (
    BYTES,
    LoadIntoEngine,
    PushToWorkers,
    RefreshEngineLayout,
    ReplicaRefresh,
    SharedWeights,
    colocated_weight_sync,
    local_weight_sync,
)


def _policy() -> SimpleNamespace:
    torch.manual_seed(0)
    return SimpleNamespace(model=nn.Linear(4, 3))  # what the parts expose: the model that generates


def _pipeline(events: list[str], received: int) -> PipelineParts:
    def refresh_replica() -> int:
        events.append("refresh")
        return received

    return PipelineParts(nn.Linear(4, 3), SimpleNamespace(refresh_replica=refresh_replica), ctx=None)


class _OwnCopyEngine:
    """An engine with weights of its own (as vLLM): records what it was given."""

    shares_trainer_weights = False

    def __init__(self, events: list[str]):
        self.events, self.loaded = events, {}

    def load_weights(self, named_tensors) -> int:
        self.events.append("load")
        self.loaded.update({n: t.clone() for n, t in named_tensors})
        return sum(t.numel() * t.element_size() for t in self.loaded.values())


def test_colocated_placements_get_their_strategy():
    events: list[str] = []
    shared_engine = SimpleNamespace(shares_trainer_weights=True)
    assert isinstance(colocated_weight_sync(shared_engine, _policy()), SharedWeights)
    assert SharedWeights().sync() == {BYTES: 0.0}
    pipeline = _pipeline(events, received=1234)
    assert isinstance(colocated_weight_sync(shared_engine, pipeline), ReplicaRefresh)
    assert ReplicaRefresh(pipeline).sync() == {BYTES: 1234.0} and events == ["refresh"]
    assert isinstance(colocated_weight_sync(_OwnCopyEngine(events), pipeline), LoadIntoEngine)


def test_the_builtin_engine_is_relaid_out_after_each_step():
    """Colocated, the built-in engine shares the parameters but decodes from a layout of its own
    (`scalerl.models.decode_model`): the sync rewrites it, so the next rollout sees the step's weights."""
    from scalerl.rollout.builtin_engine import BuiltinEngine
    from tests.tiny import tiny_model

    model = tiny_model().eval()
    engine = BuiltinEngine(model, pad_token_id=0, dtype=torch.bfloat16)
    sync = colocated_weight_sync(engine, SimpleNamespace(model=model))
    assert isinstance(sync, RefreshEngineLayout)
    prompts, greedy = [[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0)
    before = engine.generate(prompts, greedy).logprobs
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # what an optimizer step does: write the parameters in place
    assert sync.sync() == {BYTES: 0.0} and not engine.decode_model.is_stale()
    after = engine.generate(prompts, greedy).logprobs
    assert not torch.equal(before, after)


def test_an_engine_with_its_own_copy_loads_the_refreshed_replica():
    events: list[str] = []
    pipeline, engine = _pipeline(events, received=100), _OwnCopyEngine(events)
    metrics = colocated_weight_sync(engine, pipeline).sync()
    assert events == ["refresh", "load"]  # the replica is brought up to date before it is loaded
    params = dict(pipeline.model.named_parameters())
    assert set(engine.loaded) == set(params) and all(torch.equal(engine.loaded[n], params[n]) for n in params)
    assert metrics == {BYTES: 100.0 + (4 * 3 + 3) * 4}


class _Driver:
    def __init__(self, events: list[str], workers=(5, 6)):
        self.events, self.workers = events, workers

    def announce_weights(self) -> None:
        self.events.append("announce")


class _Receiver(WeightReceiver):
    def __init__(self, events: list[str]):
        super().__init__(TensorDictStore())
        self.events = events

    def handle(self, message):
        self.events.append("message")
        return super().handle(message)


def test_push_to_workers_announces_then_pushes_and_counts_every_worker():
    events: list[str] = []
    policy = _policy()
    receivers = [_Receiver(events), _Receiver(events)]
    sender = WeightSender(torch.float32, 1 << 20, InProcessChannel(receivers))
    ctx = SimpleNamespace(comm=CommCounter())
    push = PushToWorkers(policy, local_weight_sync(policy), sender, _Driver(events), ctx)
    first = push.sync()
    assert events[0] == "announce" and set(events[1:]) == {"message"}
    assert set(first) == set(SyncReport().metrics()) | {BYTES} and first["weight_sync/full_push"] == 1.0
    assert first[BYTES] == 2 * first["weight_sync/bytes"] > 0  # each of the two workers got one push
    counted = ctx.comm.pop()["comm/bytes/weight_sync"]
    assert counted == wire_bytes("broadcast", first["weight_sync/bytes"], 3, "gloo")  # rank 0 + 2 workers
    with torch.no_grad():
        policy.model.bias[0] += 1.0
    second = push.sync()
    assert second["weight_sync/full_push"] == 0.0 and 0 < second["weight_sync/bytes"] < first["weight_sync/bytes"]
    for r in receivers:
        assert torch.equal(r.store.tensors["bias"], policy.model.bias.detach())


def test_push_on_a_rank_without_the_channel_joins_and_counts_nothing():
    policy, ctx = _policy(), SimpleNamespace(comm=CommCounter())
    events: list[str] = []
    local = ReplicaRefresh(_pipeline(events, received=64))
    metrics = PushToWorkers(policy, local, WeightSender(torch.float32, 1 << 20, None), None, ctx).sync()
    assert metrics[BYTES] == 64.0 and metrics["weight_sync/bytes"] == 0.0 and events == ["refresh"]
    assert ctx.comm.pop()["comm/bytes/weight_sync"] == 0


def _output(rows: int) -> GenerationOutput:
    ones = torch.ones(rows, 2, dtype=torch.long)
    return GenerationOutput(ones, ones, ones, ones, torch.zeros(rows, 2), ["stop"] * rows)


def test_standalone_collects_the_prefetched_step_before_it_pushes():
    """One step ahead: prefetch(step 2) -> collect_prefetched() -> sync_weights() -> generate(step 2) reads
    what was collected, without a new request; pushing before collecting is refused (the workers answer in
    order, so the push would wait behind the generation)."""
    ctx = SimpleNamespace(rank=1, dp_rank=0, dp_size=1, world_size=2)  # a trainer rank that is not the driver
    rollout_cfg = SimpleNamespace(dtype="fp32", staleness=1, stale_logprobs="recompute")
    rollouts = StandaloneRollouts(_policy(), ctx, 0, rollout_cfg, load_config(None, []).weight_sync)
    pushed, collected = [], [_output(4)]
    rollouts.weight_sync = SimpleNamespace(sync=lambda: pushed.append(1) or {BYTES: 1.0})
    rollouts._collect = lambda: (setattr(rollouts, "pending", None), collected.pop())[1]
    batch = StepPrompts(2, [[1, 2]] * 4, SamplingParams(max_new_tokens=2, total_rows=4), [{}])
    rollouts.prefetch(batch)
    with pytest.raises(RuntimeError, match="collect_prefetched"):
        rollouts.sync_weights()
    assert not pushed
    rollouts.collect_prefetched()
    assert rollouts.sync_weights() == {BYTES: 1.0} and pushed == [1]
    out = rollouts.generate(batch)  # a second request would find `collected` empty
    assert out.response_ids.shape == (4, 2) and rollouts.ready is None
