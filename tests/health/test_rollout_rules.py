"""The weight-sync watchdog's leaf (`rollout/weight_sync_stall`) on records and metrics built here: a store that
did not answer, a stall where every side had done its part, workers that never joined the push, a push near
its limit, no push at all. The records of real stalls (fault injection over a spawned group) are checked in
tests/comm/weights/test_watchdog.py."""

import time

from scalerl.comm.weights.watchdog import TRAINER, WORKER, SyncProgress, stall_message, stall_record
from scalerl.health.rollout_rules import stall_finding, weight_sync_stall
from scalerl.health.tree import OK, WARNING, StepView


def test_records_without_peers_and_with_everyone_done_say_so():
    own = SyncProgress(TRAINER, 0)
    own.begin(3, buckets=4)
    own.completed("HELLO", -1, 96)
    record = stall_record(own, "every worker's acknowledgement of bucket 0 of 4", "acks",
                          {"kind": "BUCKET", "bucket": 0, "index": 1, "tensors": ["a", "b"]}, 2.0,
                          "weight_sync.timeout_s", None, 0, "Operation timed out!")
    assert "could not be read" in stall_message(record) and "frozen or gone" in stall_finding(record).fix
    done = {"role": WORKER, "sync": 3, "done": 2, "bucket": 0, "stage": "waiting", "at": time.time()}
    record = stall_record(own, "every worker's acknowledgement of bucket 0 of 4", "acks",
                          {"kind": "BUCKET", "bucket": 0, "index": 1}, 2.0, "weight_sync.timeout_s",
                          {0: {}, 1: done}, 0, "")
    assert record["stuck"] == [] and "every other side had done its part" in stall_message(record)
    assert "the link did not carry" in stall_finding(record).fix
    never = stall_record(own, "every worker joining sync 3 (its HELLO)", "acks", {"kind": "HELLO", "index": 0},
                         600.0, "trainer.dist_timeout_s", {1: {}}, 0, "")
    assert [s["rank"] for s in never["stuck"]] == [1] and "never reached" in never["stuck"][0]["state"]
    assert "did not join the push" in stall_finding(never).fix


def test_a_push_near_its_limit_warns():
    (f,) = weight_sync_stall(StepView({"weight_sync/slowest_step_s": 80.0, "weight_sync/timeout_s": 120.0}))
    assert f.status == WARNING and "67% of weight_sync.timeout_s=120 s" in f.summary and "bucket_mb" in f.fix
    (f,) = weight_sync_stall(StepView({}))
    assert f.status == OK and "nothing to watch" in f.summary
