"""The weight-sync strategies behind the rollout sources, in one process: which one each placement gets,
the bytes each reports (``comm/weight_sync_bytes``, ``weight_sync/*``), the order of a push (the workers
are told before the buckets go), the background push from a snapshot, and the standalone source's requests
K steps ahead, routed to the least-loaded worker, generated with the weights pushed before them."""

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
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams
from scalerl.rollout.sources import StandaloneRollouts, StepPrompts
from scalerl.rollout.weight_sync import (
    BYTES,
    EXPOSED,
    BackgroundPush,
    LoadIntoEngine,
    PushToWorkers,
    RefreshEngineLayout,
    ReplicaRefresh,
    SharedWeights,
    colocated_weight_sync,
    local_weight_sync,
)
from scalerl.rollout.worker.protocol import (
    OP_GENERATE,
    OP_PUSH_DIRECT,
    OP_WEIGHTS,
    RolloutWorkerError,
    WorkerDriver,
    decode_reply,
    encode_reply,
    request_op,
    token_versions,
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
    from scalerl.rollout.engines.builtin import BuiltinEngine
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
        self.events, self.workers, self.dead = events, workers, {}

    def announce_weights(self, version: int = 0) -> None:
        self.events.append("announce")

    def push_channel(self, broadcast):  # every worker alive: the push's own channel
        return broadcast


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
    assert set(first) == set(SyncReport().metrics()) | {BYTES, EXPOSED, "weight_sync/push_s"}
    assert first["weight_sync/full_push"] == 1.0 and first[EXPOSED] >= first["weight_sync/push_s"] > 0
    assert first[BYTES] == 2 * first["weight_sync/bytes"] > 0  # each of the two workers got one push
    counted = ctx.comm.pop()["comm/bytes/weight_sync"]
    assert counted == wire_bytes("broadcast", first["weight_sync/bytes"], 3, "gloo")  # rank 0 + 2 workers
    with torch.no_grad():
        policy.model.bias[0] += 1.0
    second = push.sync()
    assert second["weight_sync/full_push"] == 0.0 and 0 < second["weight_sync/bytes"] < first["weight_sync/bytes"]
    for r in receivers:
        assert torch.equal(r.store.tensors["bias"], policy.model.bias.detach())


def test_the_push_to_workers_waits_each_step_weight_sync_timeout_s_and_the_join_the_groups_limit(monkeypatch):
    import scalerl.rollout.weight_sync as weight_sync

    built = {}

    class Channel:
        def __init__(self, group, src, device, timeout_s, join_timeout_s):
            built.update(group=group, src=src, timeout_s=timeout_s, join_timeout_s=join_timeout_s)

    monkeypatch.setattr(weight_sync, "BroadcastChannel", Channel)
    cfg = load_config(None, ["weight_sync.timeout_s=7.5"])
    ctx = SimpleNamespace(rollout_group="rollout", device=torch.device("cpu"), comm=CommCounter())
    push = PushToWorkers.from_config(_policy(), ctx, object(), "fp32", cfg.weight_sync)
    assert isinstance(push.sender.channel, Channel)
    assert built == {"group": "rollout", "src": 0, "timeout_s": 7.5, "join_timeout_s": 600.0}  # no group here
    assert weight_sync.collective_limit_s("cpu", default=42.0) == 42.0


def test_push_on_a_rank_without_the_channel_joins_and_counts_nothing():
    policy, ctx = _policy(), SimpleNamespace(comm=CommCounter())
    events: list[str] = []
    local = ReplicaRefresh(_pipeline(events, received=64))
    metrics = PushToWorkers(policy, local, WeightSender(torch.float32, 1 << 20, None), None, ctx).sync()
    assert metrics[BYTES] == 64.0 and metrics["weight_sync/bytes"] == 0.0 and events == ["refresh"]
    assert ctx.comm.pop()["comm/bytes/weight_sync"] == 0


def test_background_push_sends_the_snapshot_and_reports_a_step_late():
    """The push runs on a thread from a copy taken at sync(): weights changed right after it do not reach the
    workers until the next sync, whose metrics are the previous push's (the first: the full push)."""
    events: list[str] = []
    policy = _policy()
    receivers = [_Receiver(events)]
    sender = WeightSender(torch.float32, 1 << 20, InProcessChannel(receivers))
    ctx = SimpleNamespace(comm=CommCounter())
    push = BackgroundPush(PushToWorkers(policy, local_weight_sync(policy), sender, _Driver(events), ctx))
    before = policy.model.bias.detach().clone()
    first = push.sync(version=1)
    assert first["weight_sync/bytes"] == 0.0 and first[EXPOSED] >= 0  # nothing had finished yet
    with torch.no_grad():
        policy.model.bias += 1.0  # the next update, while the push may still be running
    finished = push.wait()
    assert finished["weight_sync/full_push"] == 1.0 and finished["weight_sync/bytes"] > 0
    assert torch.equal(receivers[0].store.tensors["bias"], before)  # the snapshot went, not the live weights
    second = push.sync(version=2)
    third = push.sync(version=3)  # reports the second push: a delta carrying the change
    assert second["weight_sync/bytes"] == 0.0
    assert third["weight_sync/full_push"] == 0.0 and 0 < third["weight_sync/bytes"] < finished["weight_sync/bytes"]
    push.wait()
    assert torch.equal(receivers[0].store.tensors["bias"], policy.model.bias.detach())
    assert events.count("announce") == 3


class _QueueDriver(WorkerDriver):
    """A driver whose workers are simulated: each answers its requests in order, generating every row's
    tokens with the version of the last WEIGHTS it read before the request (as a real worker does)."""

    def __init__(self, workers=(5, 6)):
        super().__init__(SimpleNamespace(rollout_ranks=list(workers), device=torch.device("cpu"),
                                         comm=CommCounter()))
        self.queues = {w: [] for w in workers}
        self.versions = {w: 0 for w in workers}
        self.requests: list[tuple[int, int, int]] = []  # (worker, step, rows)

    def _send(self, kind, tensors, worker):
        self.queues[worker].append(tensors)
        if request_op(tensors) == OP_GENERATE:
            self.requests.append((worker, int(tensors[0][1]), tensors[3].shape[0]))
        return 0

    def _recv(self, worker):
        while True:
            message = self.queues[worker].pop(0)
            if request_op(message) != OP_GENERATE:
                if request_op(message) == OP_WEIGHTS:
                    self.versions[worker] = int(message[0][1])
                continue
            rows = message[3].shape[0]
            ones = torch.ones(rows, 2, dtype=torch.long)
            out = GenerationOutput(ones, ones, ones, ones, torch.zeros(rows, 2), ["stop"] * rows,
                                   token_versions(ones, self.versions[worker]))
            return decode_reply(encode_reply(out, int(message[0][1]), 0.25, 0.0, int(message[1][5])))  # row_offset


def _standalone(staleness: int, driver: _QueueDriver) -> StandaloneRollouts:
    ctx = SimpleNamespace(rank=1, dp_rank=0, dp_size=1, world_size=1)
    rollout_cfg = SimpleNamespace(dtype="fp32", staleness=staleness, stale_logprobs="recompute", n=1)
    rollouts = StandaloneRollouts(_policy(), ctx, 0, rollout_cfg, load_config(None, []).weight_sync)
    rollouts.driver = driver
    rollouts.weight_sync = SimpleNamespace(sync=lambda version: driver.announce_weights(version) or {})
    return rollouts


def _step(step: int, rows: int = 4, prompt_len: int = 2) -> StepPrompts:
    return StepPrompts(step, [[1] * prompt_len] * rows, SamplingParams(max_new_tokens=2, total_rows=rows), [{}])


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_requests_run_k_steps_ahead_and_lag_exactly_k_versions(staleness):
    """The trainer's loop: generate step s (sent earlier, or now), send steps up to s+K, update, push version
    s+1. Each step's samples come from version max(0, s - K): a request sent after the push of version v is
    generated with v, whatever the timing, and at most K steps are ever in flight beside the one training."""
    driver = _QueueDriver()
    rollouts = _standalone(staleness, driver)
    steps = 8
    for s in range(steps):
        out = rollouts.generate(_step(s))
        assert out.weight_versions.unique().tolist() == [max(0, s - staleness)]
        for ahead in range(s + 1, min(s + staleness, steps - 1) + 1):
            if all(b.step != ahead for b, _ in rollouts.in_flight):
                rollouts.prefetch(_step(ahead))
        assert len(rollouts.in_flight) <= staleness
        rollouts.sync_weights(version=s + 1)
        metrics = rollouts.step_metrics()
        assert metrics["timing_s/rollout_idle"] == pytest.approx(0.25)  # each worker reported 0.25 s
    assert sorted({step for _, step, _ in driver.requests}) == list(range(steps))  # each step sent once


def test_parts_go_to_the_least_loaded_worker():
    """A step's two parts go largest first to the worker with the fewest tokens in flight; with step 0 still
    owed by both, step 1's larger part goes to the worker that owes fewer tokens."""
    driver = _QueueDriver()
    rollouts = _standalone(1, driver)
    rollouts.prefetch(StepPrompts(0, [[1] * 30] + [[1] * 2] * 3, SamplingParams(max_new_tokens=2, total_rows=4), [{}]))
    assert driver.requests == [(5, 0, 1), (6, 0, 3)]  # 32 tokens to worker 5, 12 to worker 6
    assert driver.tokens_in_flight(5) == 32 and driver.tokens_in_flight(6) == 12
    assert driver.least_loaded() == 6
    rollouts.prefetch(_step(1))  # two equal parts of 8 tokens: the first to 6 (12 < 32), then 6 again (20 < 32)
    assert driver.requests[2:] == [(6, 1, 2), (6, 1, 2)]
    out = rollouts.generate(StepPrompts(0, [[1] * 30] + [[1] * 2] * 3, SamplingParams(max_new_tokens=2), [{}]))
    assert out.response_ids.shape[0] == 4 and driver.tokens_in_flight(5) == 0
    assert rollouts.generate(_step(1)).response_ids.shape[0] == 4 and driver.tokens_in_flight(6) == 0


def test_a_dead_workers_requests_go_again_to_a_live_one_and_the_last_death_stops_the_run():
    """Worker 6 dies owing step 3: the request goes again, as sent, to worker 5, which answers it; the push
    channel turns point to point, to worker 5 alone. When 5 dies too, the error names both."""
    driver = _QueueDriver()
    driver.request_generation(6, 3, SamplingParams(max_new_tokens=2, total_rows=1), torch.ones(1, 2, dtype=torch.long),
                              torch.tensor([2]), tokens=4)
    alive_recv = driver._recv

    def recv(worker):
        if worker == 6 or dead_too:
            raise RuntimeError("Connection closed by peer")
        return alive_recv(worker)

    dead_too = False
    driver._recv = recv
    assert driver.collect(3, 0).step == 3
    assert [r[:2] for r in driver.requests] == [(6, 3), (5, 3)] and driver.workers == [5] and list(driver.dead) == [6]
    broadcast = object()
    channel = driver.push_channel(broadcast)
    assert channel is not broadcast and channel.workers == [5]
    assert request_op(driver.queues[5][-1]) == OP_PUSH_DIRECT
    dead_too = True
    driver.request_generation(5, 4, SamplingParams(max_new_tokens=2, total_rows=1), torch.ones(1, 2, dtype=torch.long),
                              torch.tensor([2]), tokens=4)
    with pytest.raises(RolloutWorkerError, match=r"rollout workers \[5, 6\] all stopped answering \(the last, rank 5, "
                                                 r"owed the rollouts of steps \[4\]\).*trainer.resume=auto"):
        driver.collect(4, 0)


@pytest.mark.parametrize("rollout_dtype, precision, training_dtype, stale_logprobs, matches", [
    ("fp32", "fp32", torch.float32, "recompute", True),
    ("fp32", "bf16", torch.bfloat16, "recompute", True),  # workers decode bf16 over their fp32 copy
    ("bf16", "bf16", torch.bfloat16, "recompute", False),  # a bf16 copy: bf16 norms and residual
    ("fp32", "auto", torch.bfloat16, "recompute", False),  # auto resolved after the workers started: fp32
    ("fp32", "bf16", None, "recompute", False),  # the trainer's own engine could not match (CUDA, unfused)
    ("fp32", "bf16", torch.bfloat16, "behavior", True),  # stale, but the behaviour policy's log-probs
])
def test_standalone_workers_match_the_training_forward_where_they_decode_by_its_recipe(
        rollout_dtype, precision, training_dtype, stale_logprobs, matches):
    from scalerl.rollout.sources import workers_compute_dtype

    ctx = SimpleNamespace(rank=1, dp_rank=0, dp_size=1, world_size=1)
    rollout_cfg = SimpleNamespace(dtype=rollout_dtype, staleness=int(stale_logprobs == "behavior"),
                                  stale_logprobs=stale_logprobs, n=1)
    rollouts = StandaloneRollouts(_policy(), ctx, 0, rollout_cfg, load_config(None, []).weight_sync, precision,
                                  training_dtype)
    assert rollouts.logprobs_match_training_forward == matches
    assert workers_compute_dtype(rollout_dtype, precision) == (
        torch.bfloat16 if "bf16" in (rollout_dtype, precision) and precision != "auto" else torch.float32)
