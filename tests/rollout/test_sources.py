"""Standalone rollout workers: the same rollouts as colocated generation (row-indexed random draws, however
the rows are split over workers), weights pushed every step, one-step asynchronous mode, bf16 workers with
importance weights, resume."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scalerl.rollout.engines.engine import GenerationOutput
from scalerl.rollout.sources import token_split
from tests.spawned_group import die_at_generate, run_case, run_in_group, skip_if_unsupported
from tests.tiny import tiny_overrides

BASE = tiny_overrides("data.num_train=64", "actor.ppo_micro_batch_size=8", "actor.lr=1e-3",
                      "data.reward=scalerl.verify:response_length_reward")


def test_token_split_is_contiguous_and_balanced():
    lengths = [10, 10, 10, 10, 40, 40]
    parts = token_split(lengths, 2)
    assert parts == [(0, 5), (5, 6)] or parts == [(0, 4), (4, 6)]
    assert [r for a, b in parts for r in range(a, b)] == list(range(6))
    assert token_split([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="rollout.workers"):
        token_split([1, 1], 3)


def test_token_split_cuts_between_whole_groups():
    """Groups of 4 samples: every cut falls on a group boundary (a prompt's samples go to one worker, so each
    worker's reply is whole groups the trainer can score at once), still balanced by tokens."""
    lengths = [5] * 8 + [50] * 4 + [5] * 4  # four groups; the third is long
    parts = token_split(lengths, 2, group_size=4)
    assert all(a % 4 == 0 and b % 4 == 0 for a, b in parts)
    assert [r for a, b in parts for r in range(a, b)] == list(range(16))
    assert parts == [(0, 12), (12, 16)]  # the first cut past half the tokens: 240 of 260, then 20
    assert token_split([1] * 12, 3, group_size=4) == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="2 prompt groups cannot be split over 3 rollout workers"):
        token_split([1] * 8, 3, group_size=4)


def test_generation_output_rows_and_concat_round_trip():
    out = GenerationOutput(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[1, 2, 0], [3, 0, 0]]), response_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]),
        logprobs=torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]), finish_reasons=["stop", "length"],
    )
    first, second = out.rows(0, 1), out.rows(1, 2)
    assert first.prompt_ids.tolist() == [[5, 6]] and first.response_ids.tolist() == [[1, 2]]
    assert second.response_ids.tolist() == [[3]]
    joined = GenerationOutput.concat([first, second], pad_token_id=0)
    for name in ("prompt_ids", "prompt_mask", "response_mask", "logprobs"):
        assert torch.equal(getattr(joined, name), getattr(out, name)[:, : getattr(joined, name).shape[1]]), name
    assert joined.finish_reasons == ["stop", "length"]


def _train(out: str, extra: list[str]):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train

    result = run_case(out, lambda: train(load_config(None, [*BASE, *extra, f"trainer.output_dir={out}"])))
    return None if result is None else result.get("final_model")


def _world2_runs(rank: int, out: str) -> None:
    for name, extra in {
        "sync": ["rollout.placement=standalone", "trainer.total_steps=3"],
        "async": ["rollout.placement=standalone", "rollout.staleness=1", "trainer.total_steps=3"],
        "async_behavior": ["rollout.placement=standalone", "rollout.staleness=1", "rollout.stale_logprobs=behavior",
                           "trainer.total_steps=3"],
        "bf16": ["rollout.placement=standalone", "rollout.dtype=bf16", "trainer.total_steps=3"],
        "partial": ["rollout.placement=standalone", "rollout.staleness=2", "rollout.partial=true",
                    "trainer.total_steps=3"],
        "precision_bf16": ["rollout.placement=standalone", "trainer.precision=bf16", "trainer.total_steps=3"],
        "resumed": ["rollout.placement=standalone", "trainer.total_steps=2", "trainer.save_every=2"],
        # colocated, 32 rows: each pipeline rank's replica generates half (16 rows, the split's threshold)
        "pipeline": ["parallel.pp=2", "trainer.total_steps=3", "trainer.batch_size=8"],
    }.items():
        _train(f"{out}/{name}", extra)
    _train(f"{out}/resumed", ["rollout.placement=standalone", "trainer.total_steps=3", "trainer.resume=auto"])


def _two_workers(rank: int, out: str) -> None:
    _train(f"{out}/two_workers", ["rollout.placement=standalone", "rollout.workers=2", "trainer.total_steps=3"])
    k2 = ["rollout.placement=standalone", "rollout.workers=2", "rollout.staleness=2"]
    _train(f"{out}/two_workers_k2", [*k2, "trainer.total_steps=4"])
    _train(f"{out}/resumed_k2", [*k2, "trainer.total_steps=2", "trainer.save_every=2"])
    _train(f"{out}/resumed_k2", [*k2, "trainer.total_steps=4", "trainer.resume=auto"])
    # Last, as it leaves the group one rank short: worker rank 2 dies while generating its part of step 2.
    if rank == 2:
        die_at_generate(2)
    _train(f"{out}/worker_dies", ["rollout.placement=standalone", "rollout.workers=2", "trainer.total_steps=3"])


def _worker_dies_one_step_ahead(rank: int, out: str) -> None:
    if rank == 2:
        die_at_generate(2)
    _train(f"{out}/worker_dies_k1", ["rollout.placement=standalone", "rollout.workers=2", "rollout.staleness=1",
                                     "trainer.total_steps=4", "trainer.dist_timeout_s=120"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("standalone")
    _train(str(out / "colocated"), ["trainer.total_steps=3"])  # the reference: one process
    _train(str(out / "colocated_32_rows"), ["trainer.total_steps=3", "trainer.batch_size=8"])
    _train(str(out / "colocated_bf16"), ["trainer.total_steps=3", "trainer.precision=bf16"])
    run_in_group(_world2_runs, 2, str(out), timeout_s=900)
    run_in_group(_two_workers, 3, str(out), timeout_s=600, may_vanish=(2,))
    run_in_group(_worker_dies_one_step_ahead, 3, str(out), timeout_s=600, may_vanish=(2,))
    return out


def _metrics(run: Path) -> list[dict]:
    skip_if_unsupported(run)
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] > 0]


def _weights(run: Path) -> dict:
    skip_if_unsupported(run)
    return load_file(str(run / "final" / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("run", ["sync", "two_workers"])
def test_standalone_workers_reproduce_colocated_generation(runs, run):
    reference, mine = _metrics(runs / "colocated"), _metrics(runs / run)
    assert [r["critic/score/mean"] for r in mine] == [r["critic/score/mean"] for r in reference]
    assert [r["response_length/mean"] for r in mine] == [r["response_length/mean"] for r in reference]
    assert _max_diff(_weights(runs / "colocated"), _weights(runs / run)) < 1e-5
    assert all(r["comm/weight_sync_bytes"] > 0 for r in mine)  # every step pushed the new weights


def test_asynchronous_rollouts_lag_one_step(runs):
    rows = _metrics(runs / "async")
    assert rows[0]["rollout/logprob_diff/max"] < 1e-4  # the first step's rollouts came from its own weights
    assert all(r["rollout/logprob_diff/max"] > 1e-3 for r in rows[1:])  # later ones from the previous step's
    reference = _metrics(runs / "colocated")
    assert rows[0]["critic/score/mean"] == reference[0]["critic/score/mean"]


def test_behaviour_logprobs_skip_the_recompute(runs):
    """rollout.stale_logprobs=behavior: PPO's ratio against the policy that generated the rollouts, whose fp32
    log-probs the workers return; no recompute, so no mismatch metric. Steps 1 and 2 generate with the
    initial weights in both asynchronous runs, so their rollouts are the same."""
    behavior, recompute = _metrics(runs / "async_behavior"), _metrics(runs / "async")
    assert all("rollout/logprob_diff/max" not in r for r in behavior)
    assert [r["critic/score/mean"] for r in behavior[:2]] == [r["critic/score/mean"] for r in recompute[:2]]
    assert sum(r["timing_s/old_log_prob"] for r in behavior) < 0.5 * sum(r["timing_s/old_log_prob"]
                                                                          for r in recompute)
    assert 0 < _max_diff(_weights(runs / "async_behavior"), _weights(runs / "async")) < 1e-2


def test_bf16_workers_hold_half_the_bytes_and_reweight_the_loss(runs):
    bf16, fp32 = _metrics(runs / "bf16"), _metrics(runs / "sync")
    assert bf16[0]["weight_sync/full_bytes"] * 2 == fp32[0]["weight_sync/full_bytes"]
    assert all(0 < r["rollout/logprob_diff/max"] < 0.05 for r in bf16)  # bf16 numerics, same weights


def test_under_bf16_workers_decode_by_the_training_forwards_recipe(runs):
    """trainer.precision=bf16 with fp32 worker copies: the workers decode in bf16 as the colocated engine does
    (the same samples and weights), and their log-probs stand in for the old-log-prob pass in both."""
    standalone, colocated = _metrics(runs / "precision_bf16"), _metrics(runs / "colocated_bf16")
    assert [r["critic/score/mean"] for r in standalone] == [r["critic/score/mean"] for r in colocated]
    assert all("rollout/logprob_diff/max" not in r for r in standalone + colocated)  # not recomputed
    assert _max_diff(_weights(runs / "colocated_bf16"), _weights(runs / "precision_bf16")) < 1e-5


@pytest.mark.parametrize("run", ["sync", "bf16", "async", "two_workers", "two_workers_k2"])
def test_weight_sync_sends_verified_deltas(runs, run):
    """After the first (full) push at start, every step sends only what changed, and every bucket verified.
    With staleness >= 1 the push runs in the background and a step reports the previous one's: the first
    step reports the full push at start."""
    rows = _metrics(runs / run)
    if run in ("async", "two_workers_k2"):
        assert rows[0]["weight_sync/full_push"] == 1.0
        rows = rows[1:]
    assert all(r["weight_sync/resyncs"] == 0 and r["weight_sync/full_push"] == 0 for r in rows)
    assert all(0 < r["weight_sync/bytes"] < r["weight_sync/full_bytes"] for r in rows)


def test_k_steps_ahead_lag_k_versions_over_two_workers(runs):
    """rollout.staleness=2 over two workers: step s trains on samples of version max(0, s - 2) (steps are
    1-based in the log), none dropped; both idle times and the push's exposed time are reported."""
    rows = _metrics(runs / "two_workers_k2")
    assert [r["rollout/staleness/max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/staleness/hist/2"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    assert all(r["rollout/dropped_stale"] == 0 for r in rows)
    assert all(r["timing_s/trainer_idle"] >= 0 and r["timing_s/rollout_idle"] >= 0 for r in rows)
    assert all(0 <= r["timing_s/weight_sync_exposed"] <= r["timing_s/update_weights"] + 1e-3 for r in rows)
    reference = _metrics(runs / "colocated")
    assert rows[0]["critic/score/mean"] == reference[0]["critic/score/mean"]  # step 1: the initial weights


def test_partial_rollouts_train_within_the_bound(runs):
    """rollout.partial=true (streaming workers): the first step samples what the colocated run samples (every
    row's draws its own, whatever shares the batch), no sample lags more than K=2 versions or is dropped,
    and the share of responses that span versions is reported (where a push lands depends on timing)."""
    rows, reference = _metrics(runs / "partial"), _metrics(runs / "colocated")
    assert rows[0]["critic/score/mean"] == reference[0]["critic/score/mean"]
    assert rows[0]["response_length/mean"] == reference[0]["response_length/mean"]
    assert [r["rollout/staleness/max"] <= min(i, 2) for i, r in enumerate(rows)] == [True] * 3
    assert all(r["rollout/dropped_stale"] == 0 and 0 <= r["rollout/partial_fraction"] <= 1 for r in rows)


def test_a_dead_workers_requests_go_to_the_live_one(runs):
    """Worker rank 2 is killed in step 2: its part of the step goes again to rank 1 and the pushes from then
    on go to rank 1 alone; the run finishes with what two live workers give (every row's draws are its
    own), the death counted from step 2."""
    straight, survived = _metrics(runs / "two_workers"), _metrics(runs / "worker_dies")
    assert [r["rollout/dead_workers"] for r in survived] == [0.0, 1.0, 1.0]
    assert [r["rollout/last_dead_worker"] for r in survived] == [-1.0, 2.0, 2.0]
    assert [r["critic/score/mean"] for r in survived] == [r["critic/score/mean"] for r in straight]
    assert [r["response_length/mean"] for r in survived] == [r["response_length/mean"] for r in straight]
    assert _max_diff(_weights(runs / "two_workers"), _weights(runs / "worker_dies")) < 1e-5
    assert all(r["weight_sync/resyncs"] == 0 for r in survived)


def test_a_worker_dying_one_step_ahead_cuts_a_background_push_short_and_the_run_goes_on(runs):
    """Staleness 1: worker rank 2 dies in step 2 while the background push of version 1 is under way; the
    push fails, the live worker keeps its weights and takes a full push at the next step, point to point,
    and the run trains its 4 steps. What the live worker generated with the weights it kept may be more
    than K=1 versions behind by training time: such samples are dropped from the loss and counted."""
    rows = _metrics(runs / "worker_dies_k1")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/dead_workers"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert any(r["weight_sync/full_push"] == 1.0 for r in rows[1:])  # the live worker's full push after
    assert all(r["rollout/staleness/max"] <= 1 or r["rollout/dropped_stale"] > 0 for r in rows)
    assert rows[0]["rollout/dropped_stale"] == 0


def test_resume_regenerates_the_steps_in_flight(runs):
    """Saved after step 2 with steps 3 and 4 in flight: the resumed run draws them again and generates them
    with the restored weights (so its first step is on-policy), then lags as before."""
    straight, resumed = _metrics(runs / "two_workers_k2"), _metrics(runs / "resumed_k2")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["critic/score/mean"] for r in resumed[:2]] == [r["critic/score/mean"] for r in straight[:2]]
    assert [r["rollout/staleness/max"] for r in resumed[2:]] == [0.0, 1.0]


def test_standalone_resume_is_bitwise_identical(runs):
    straight, resumed = _weights(runs / "sync"), _weights(runs / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [r["step"] for r in _metrics(runs / "resumed")] == [1, 2, 3]


@pytest.mark.parametrize("run", ["sync", "two_workers"])
def test_standalone_steps_count_what_the_trainer_sends(runs, run):
    # scalerl.comm.counting.accounting: prompts out (rollout), weights pushed to every worker (weight_sync, which also
    # counts each push's small header message, so at least comm/weight_sync_bytes)
    for row in _metrics(runs / run):
        assert row["comm/bytes/rollout"] > 0
        assert row["comm/bytes/weight_sync"] >= row["comm/weight_sync_bytes"] > 0
        assert row["comm/bytes/total"] >= row["comm/bytes/rollout"] + row["comm/bytes/weight_sync"]


def test_pipeline_ranks_split_generation_and_reproduce_one_process(runs):
    """With pp=2 each pipeline rank generates half of the rows on its replica and they exchange them: the
    same samples as one process (scores and lengths equal), each rank sending one half's outputs per step
    (32 rows of 8 prompts x 4 samples: 16 rows x (16 B per prompt token + 24 B per response token + 1) and
    the 232-byte message header, under 16 x (16 x 64 + 24 x 8 + 1) + 232 at the longest prompts)."""
    reference, mine = _metrics(runs / "colocated_32_rows"), _metrics(runs / "pipeline")
    assert [r["critic/score/mean"] for r in mine] == [r["critic/score/mean"] for r in reference]
    assert [r["response_length/mean"] for r in mine] == [r["response_length/mean"] for r in reference]
    for row in mine:
        assert 232 < row["comm/bytes/rollout"] < 16 * (16 * 64 + 24 * 8 + 1) + 232
