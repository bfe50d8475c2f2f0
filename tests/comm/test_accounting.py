"""CommCounter: wire-byte formulas per collective and backend, per-step metrics with a fixed key set,
DDP's exposed-time tracking, and the declared reductions of the metrics it emits."""

import threading

import pytest
import torch

from scalerl.comm.counting.accounting import KINDS, TIMED_KINDS, CommCounter
from scalerl.comm.counting.collective_bytes import binomial_tree_sends, mean_wire_bytes, wire_bytes
from scalerl.perf.metrics import reduction_of

S = 1000.0


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_formulas(n):
    assert wire_bytes("all_reduce", S, n) == pytest.approx(2 * (n - 1) / n * S)
    assert wire_bytes("all_gather", S, n) == pytest.approx((n - 1) / n * S)
    assert wire_bytes("all_to_all", S, n) == pytest.approx((n - 1) / n * S)
    assert wire_bytes("reduce_scatter", S, n, backend="nccl") == pytest.approx((n - 1) / n * S)
    # gloo's reduce-scatter is an all-reduce underneath (measured on the emulated network)
    assert wire_bytes("reduce_scatter", S, n, backend="gloo") == pytest.approx(2 * (n - 1) / n * S)
    assert wire_bytes("send", S, n) == S and wire_bytes("recv", S, n) == 0


def test_nothing_moves_in_a_group_of_one():
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"):
        assert wire_bytes(op, S, 1) == 0


def test_broadcast_trees():
    # gloo: binomial tree; every non-root receives once, so the group sends (n-1) x S in all
    assert [binomial_tree_sends(v, 4) for v in range(4)] == [2, 1, 0, 0]  # measured: 2.0 / 1.0 / 0 / 0 x S
    assert [binomial_tree_sends(v, 2) for v in range(2)] == [1, 0]
    for n in (2, 3, 5, 8, 13):
        assert sum(binomial_tree_sends(v, n) for v in range(n)) == n - 1
        chain = [wire_bytes("broadcast", S, n, "nccl", group_rank=r, root=1) for r in range(n)]
        assert sum(chain) == (n - 1) * S and chain[0] == 0  # rank 0 is last in a chain rooted at 1
        for backend in ("gloo", "nccl"):
            assert mean_wire_bytes("broadcast", S, n, backend) == pytest.approx((n - 1) / n * S)
    # the root is relative: rank 2 rooting a 4-rank broadcast sends 2 x S
    assert wire_bytes("broadcast", S, 4, "gloo", group_rank=2, root=2) == 2 * S
    assert wire_bytes("broadcast", S, 4, "gloo", group_rank=3, root=2) == S


def test_unknown_kind_or_op_is_refused():
    counter = CommCounter()
    with pytest.raises(ValueError, match="unknown communication kind 'gradient'"):
        counter.record("gradient", "all_reduce", S, 2)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        counter.record("grad", "allreduce", S, 2)


def test_step_metrics_have_fixed_keys_and_pop_resets():
    counter = CommCounter()
    empty_keys = set(counter.step_metrics())
    counter.declare("grad", "dp_shard")
    counter.record("grad", "reduce_scatter", S, 4, dim="dp_shard")  # gloo: 1.5 S
    counter.record("grad", "all_reduce", S / 4, 2, dim="dp_replicate")  # 0.25 S
    counter.record("tp", "all_gather", S, 2, dim="tp")  # 0.5 S
    counter.add_wait("grad", 0.25)
    metrics = counter.pop()
    assert set(metrics) == empty_keys | {"comm/bytes/grad/dp_shard"}
    assert {f"comm/bytes/{k}" for k in KINDS} | {f"timing_s/comm/{k}" for k in TIMED_KINDS} <= set(metrics)
    assert metrics["comm/bytes/grad"] == pytest.approx(1.75 * S)
    assert metrics["comm/bytes/grad/dp_shard"] == pytest.approx(1.5 * S)
    assert metrics["comm/bytes/tp"] == pytest.approx(0.5 * S)
    assert metrics["comm/bytes/total"] == pytest.approx(2.25 * S)
    assert metrics["timing_s/comm/grad"] == 0.25 and metrics["timing_s/comm/param"] == 0
    after = counter.pop()
    assert set(after) == set(metrics) and all(v == 0 for v in after.values())  # declared keys survive reset
    for key in after:
        reduction_of(key)  # every key has a declared reduction
    assert reduction_of("comm/bytes/grad") == "mean" and reduction_of("comm/bytes/total") == "spread"


def test_breakdown_and_calls():
    counter = CommCounter(backend="nccl")
    counter.record("param", "all_gather", S, 4, dim="dp_shard")
    counter.record("param", "all_gather", S, 4, dim="dp_shard")
    assert counter.breakdown() == {("param", "all_gather", "dp_shard"): 1.5 * S}
    assert counter.calls() == {("param", "all_gather", "dp_shard"): 2}
    assert counter.bytes_by("param", dim="dp_shard") == 1.5 * S and counter.bytes_by("grad") == 0


def test_ddp_exposed_time_runs_from_last_issue_to_last_completion():
    counter = CommCounter()
    first, last = torch.futures.Future(), torch.futures.Future()
    chained_first = counter.track_bucket("grad", first, is_last=False)
    chained_last = counter.track_bucket("grad", last, is_last=True)
    last.set_result(torch.ones(2))  # the last bucket finishes first: still waiting for the other
    assert counter.step_metrics()["timing_s/comm/grad"] == 0
    threading.Event().wait(0.05)
    first.set_result(torch.zeros(2))
    waited = counter.step_metrics()["timing_s/comm/grad"]
    assert 0.04 < waited < 1.0
    assert chained_first.wait().tolist() == [0, 0] and chained_last.wait().tolist() == [1, 1]  # values pass through


def test_a_failed_bucket_fails_the_chained_future():
    counter = CommCounter()
    fut = torch.futures.Future()
    chained = counter.track_bucket("grad", fut, is_last=True)
    fut.set_exception(RuntimeError("gloo: connection reset"))
    with pytest.raises(RuntimeError, match="connection reset"):
        chained.wait()
