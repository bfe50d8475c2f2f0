"""The weight-sync watchdog, proven by fault injection over one gloo group of 3 ranks (the trainer's rank 0,
workers 1 and 2), with a step limit of `LIMIT_S`: a healthy push raises nothing and the doctor's leaf is quiet;
a worker that stops receiving at bucket `STALL_AT` (it sleeps in that bucket's apply) is named, with the
bucket and its tensors, by the trainer and by the other worker, and the stopped worker, once it wakes, names the
trainer as the side that no longer sends; a trainer stuck preparing bucket `STALL_AT` (its gather emulated by
a sleep) is named by both workers. Every case ends within a few limits, not the collective's own timeout."""

import time

import pytest
import torch

from scalerl.comm.weights.watchdog import TRAINER, WORKER
from scalerl.core.config import ConfigError, load_config
from scalerl.health.rollout_rules import stall_failure_text, stall_finding, weight_sync_stall
from scalerl.health.tree import FAULT, OK, StepView
from tests.spawned_group import run_in_group

LIMIT_S = 1.0
PAUSE_S = 3 * LIMIT_S  # how long the injected fault holds its side
STALL_AT = 2
BUCKET_BYTES = 512  # two 64-element fp32 tensors per bucket: 4 buckets


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(64, generator=g)) for i in range(8)]


def _ranks(rank):
    from datetime import timedelta

    import torch.distributed as dist

    import scalerl.comm.weights.sender as sender_module
    from scalerl.comm.weights.channel import BroadcastChannel, Kind, WeightSyncStalled, serve_broadcast
    from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
    from scalerl.comm.weights.sender import WeightSender

    class StopsAt(WeightReceiver):
        """A receiver that stops (sleeps) when bucket `STALL_AT` comes, on the ranks told to."""

        def __init__(self, stops: bool):
            super().__init__(TensorDictStore())
            self.stops = stops

        def handle(self, message):
            if self.stops and message.kind == Kind.BUCKET and message.bucket == STALL_AT:
                time.sleep(PAUSE_S)
            return super().handle(message)

    from scalerl.comm.weights.watchdog import collective_limit_s

    out = {"collective_limit_s": collective_limit_s("cpu")}  # what a push's HELLO waits in a run
    # Each case on a group of its own: a stalled case leaves collectives pending on its group, dropped after
    # that group's short timeout (long enough that the stopped worker, awake again, still meets the others'
    # pending gather of its bucket's acknowledgements).
    groups = {case: dist.new_group([0, 1, 2], timeout=timedelta(seconds=timeout))
              for case, timeout in (("healthy", 60), ("worker_stops", 6), ("trainer_stops", 5))}

    def channel(case):
        return BroadcastChannel(groups[case], src=0, timeout_s=LIMIT_S, join_timeout_s=60)

    # ---- healthy: a full push and a delta push
    if rank == 0:
        sender = WeightSender(torch.float32, BUCKET_BYTES, channel("healthy"))
        reports = [sender.sync(_tensors(seed)) for seed in (0, 1)]
        out["healthy"] = {"metrics": [r.metrics() for r in reports], "full_push": [r.full_push for r in reports]}
    else:
        receiver = StopsAt(stops=False)
        for _ in range(2):
            serve_broadcast(receiver.handle, groups["healthy"], src=0, timeout_s=60)
        out["healthy"] = {"held": {n: t.clone() for n, t in receiver.store.tensors.items()}}

    # ---- worker 2 stops receiving at bucket STALL_AT
    start = time.monotonic()
    try:
        if rank == 0:
            WeightSender(torch.float32, BUCKET_BYTES, channel("worker_stops")).sync(_tensors(0))
        else:
            receiver = StopsAt(stops=rank == 2)
            serve_broadcast(receiver.handle, groups["worker_stops"], src=0, timeout_s=60)
        out["worker_stops"] = None
    except WeightSyncStalled as e:
        out["worker_stops"] = {"text": str(e), "record": e.record, "seconds": time.monotonic() - start}

    # ---- the trainer stops sending while preparing bucket STALL_AT (a stuck gather, emulated)
    real = sender_module._materialise
    tensors = _tensors(0)
    stuck = dict(tensors)[f"layer{2 * STALL_AT}.weight"].data_ptr()  # the first tensor of bucket STALL_AT

    def stuck_gather(t):
        if t.data_ptr() == stuck:
            time.sleep(PAUSE_S)
        return real(t)

    start = time.monotonic()
    try:
        if rank == 0:
            sender_module._materialise = stuck_gather
            WeightSender(torch.float32, BUCKET_BYTES, channel("trainer_stops")).sync(tensors)
        else:
            serve_broadcast(StopsAt(stops=False).handle, groups["trainer_stops"], src=0, timeout_s=60)
        out["trainer_stops"] = None
    except WeightSyncStalled as e:
        out["trainer_stops"] = {"text": str(e), "record": e.record, "seconds": time.monotonic() - start}
    finally:
        sender_module._materialise = real
    dist.barrier()  # a rank that left would close its connections under the others' last waits
    return out


GROUP_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def group_results():
    return run_in_group(_ranks, 3, timeout_s=GROUP_TIMEOUT_S)


def test_a_healthy_push_raises_nothing_and_the_leaf_is_quiet(group_results):
    trainer, *workers = group_results
    assert trainer["collective_limit_s"] == GROUP_TIMEOUT_S  # the default group's limit, read back
    healthy = trainer["healthy"]
    assert healthy["full_push"] == [True, False]
    for worker in workers:  # what the workers hold is the trainer's second set of weights
        held = worker["healthy"]["held"]
        assert all(torch.equal(held[n], t) for n, t in _tensors(1))
    for metrics in healthy["metrics"]:
        assert metrics["weight_sync/timeout_s"] == LIMIT_S
        assert 0 < metrics["weight_sync/slowest_step_s"] < LIMIT_S
        (finding,) = weight_sync_stall(StepView(metrics))
        assert finding.status == OK and finding.leaf == "rollout/weight_sync_stall", finding


def test_a_worker_that_stops_receiving_is_named_by_the_trainer_and_the_other_worker(group_results):
    trainer, first, stopped = (r["worker_stops"] for r in group_results)
    record = trainer["record"]
    assert record["side"] == TRAINER and record["rank"] == 0 and record["phase"] == "acks"
    assert record["kind"] == "BUCKET" and record["bucket"] == STALL_AT and record["buckets"] == 4
    assert record["tensors"] == ["layer4.weight", "layer5.weight"]
    assert record["last_bucket"] == STALL_AT - 1 and record["bytes"] > 0
    assert [s["rank"] for s in record["stuck"]] == [2]  # worker 1 had answered: only 2 is named
    assert "applying bucket 2" in record["stuck"][0]["state"]
    text = trainer["text"]
    assert "trainer rank 0 sending" in text and f"bucket {STALL_AT} of 4" in text and "layer4.weight" in text
    assert "weight_sync.timeout_s=1 s" in text and "worker rank 2:" in text
    assert trainer["seconds"] < PAUSE_S  # the limit ended the wait, not the worker waking up
    # the other worker waited for the acknowledgements and names the same one
    assert first["record"]["side"] == WORKER and first["record"]["rank"] == 1
    assert first["record"]["bucket"] == STALL_AT and [s["rank"] for s in first["record"]["stuck"]] == [2]
    assert "worker rank 1 receiving" in first["text"] and first["seconds"] < PAUSE_S
    # the stopped worker, once awake, finds the trainer no longer sending
    assert stopped["record"]["side"] == WORKER and stopped["record"]["phase"] == "receive"
    assert 0 in [s["rank"] for s in stopped["record"]["stuck"]] and "trainer rank 0" in stopped["text"]


def test_the_leaf_names_the_stuck_worker_and_what_to_check(group_results):
    record = group_results[0]["worker_stops"]["record"]
    finding = stall_finding(record)
    assert finding.status == FAULT and finding.leaf == "rollout/weight_sync_stall" and finding.ranks == (2,)
    assert "worker rank 2 stopped receiving at bucket 2" in finding.fix and "weight_sync.timeout_s" in finding.fix
    (from_context,) = weight_sync_stall(StepView({}, context={"weight_sync_stall": record}))
    assert from_context == finding
    text = stall_failure_text(record)
    assert text.startswith("weight sync stalled (trainer rank 0 sending") and "Fix: worker rank 2" in text


def test_a_trainer_that_stops_sending_is_named_by_the_workers(group_results):
    trainer, *workers = (r["trainer_stops"] for r in group_results)
    for rank, worker in enumerate(workers, start=1):
        record = worker["record"]
        assert record["side"] == WORKER and record["rank"] == rank and record["phase"] == "receive"
        assert record["last_bucket"] == STALL_AT - 1
        (trainer_place,) = [s for s in record["stuck"] if s["rank"] == 0]
        assert f"preparing bucket {STALL_AT} of 4" in trainer_place["state"]
        assert trainer_place["quiet_s"] < PAUSE_S  # named while the trainer was still stuck, within a few limits
        finding = stall_finding(record)
        assert finding.status == FAULT and "the trainer (rank 0) stopped sending" in finding.fix
    # the trainer, once it sends again, finds the workers gone
    record = trainer["record"]
    assert record["side"] == TRAINER and record["bucket"] == STALL_AT
    if record["phase"] == "acks":  # (its small broadcast may instead stall in the sockets: then no one is behind)
        assert {s["rank"] for s in record["stuck"]} == {1, 2}


class _FailingAt:
    """A point-to-point-like channel (no limit of its own) whose exchange of bucket `STALL_AT` raises ``error``."""

    def __init__(self, error: RuntimeError):
        from scalerl.comm.weights.channel import InProcessChannel
        from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver

        self.inner, self.error, self.workers = InProcessChannel([WeightReceiver(TensorDictStore())]), error, [1]
        self.num_receivers = 1

    def exchange(self, message):
        if message.bucket == STALL_AT:
            raise self.error
        return self.inner.exchange(message)

    def abort(self, message):
        self.inner.abort(message)


def test_a_timeout_on_a_channel_without_a_limit_is_named_with_the_groups_limit_and_other_errors_pass():
    from scalerl.comm.weights.channel import WeightSyncError, WeightSyncStalled
    from scalerl.comm.weights.sender import WeightSender

    sender = WeightSender(torch.float32, BUCKET_BYTES, _FailingAt(RuntimeError("Timed out waiting 600000ms for recv")))
    with pytest.raises(WeightSyncStalled) as stalled:
        sender.sync(_tensors(0))
    record = stalled.value.record
    assert record["limit_key"] == "trainer.dist_timeout_s" and record["limit_s"] == 600.0  # no group: the default
    assert record["bucket"] == STALL_AT and record["tensors"] == ["layer4.weight", "layer5.weight"]
    assert not record["peers_read"] and sender.version == 0  # the next push is a full one
    other = WeightSender(torch.float32, BUCKET_BYTES, _FailingAt(RuntimeError("Connection closed by peer")))
    with pytest.raises(RuntimeError, match="Connection closed by peer") as failed:
        other.sync(_tensors(0))
    assert not isinstance(failed.value, WeightSyncError)  # not a stall: left to the worker-death handling


def test_the_limit_is_a_validated_config_key():
    assert load_config(None, ["weight_sync.timeout_s=30"]).weight_sync.timeout_s == 30
    with pytest.raises(ConfigError, match="weight_sync.timeout_s"):
        load_config(None, ["weight_sync.timeout_s=0"])
