"""The streaming trainer (rollout.stream_groups): the per-part forward passes equal one pass over the whole
batch bit for bit, whatever order the parts come in; a streamed run over two standalone workers trains
exactly what the unstreamed run trains (losses and final weights, synchronous, one step ahead and with
dynamic sampling) and survives a worker dying mid-step; the key is refused where it cannot apply."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from scalerl.core.config import ConfigError, load_config
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.mesh import ParallelDims
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams
from scalerl.trainer.forward_passes import response_logprobs
from scalerl.trainer.rl_step import RolloutPhase
from scalerl.trainer.run_checks import check_rl_layout
from scalerl.trainer.streamed_step import StreamedStep
from tests.spawned_group import (
    delay_later_rows,
    die_at_generate,
    run_case,
    run_in_group,
    skip_if_unsupported,
)
from tests.tiny import TINY, tiny_model, tiny_overrides


def _generated(model, rows: int) -> GenerationOutput:
    """``rows`` responses of varied prompt and response lengths (so parts and micro-batches pad differently)."""
    prompts = [[1] + [3 + (i * 7 + j) % 50 for j in range(2 + i % 5)] for i in range(rows)]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, stop_token_ids=[2, 9, 17])
    return BuiltinEngine(model, pad_token_id=0).generate(prompts, sampling)


def test_parts_in_any_order_give_the_whole_batch_pass_bit_for_bit():
    """Parts [0, 4) and [4, 12) with micro-batches of 3: the second part (first to come) completes
    micro-batches 6 and 9 at once; 0 waits for nothing more than the first part; 3 straddles the two
    and runs once both are in. Each pass sees the whole-batch pass's micro-batch tensors (after trimming),
    which is what makes the results exact on any backend (on this CPU a part-local micro-batch cut happens to
    give equal log-probs too), and the assembled log-probs equal one pass over the whole batch exactly."""
    model = tiny_model(seed=1).eval()
    out = _generated(model, 12)
    batch = RolloutBatch.from_generation(out, torch.zeros(12, dtype=torch.long), torch.zeros(12))
    whole = response_logprobs(model, batch, 1.0, 3)
    ran = []

    def old(micro: RolloutBatch) -> torch.Tensor:
        ran.append(micro.trimmed()[0])
        return response_logprobs(model, micro, 1.0, 3)

    streamed = StreamedStep(12, 3, {"old": old}, pad_token_id=0)
    streamed.add(4, out.rows(4, 12))
    assert streamed.pending == [0, 3] and len(ran) == 2  # micro-batches 6 and 9 ran on arrival
    streamed.add(0, out.rows(0, 4))
    assert streamed.pending == [] and len(ran) == 4
    for micro, first in zip(ran, [6, 9, 0, 3]):
        expected = batch.select(torch.arange(first, first + 3)).trimmed()[0]
        assert torch.equal(micro.input_ids, expected.input_ids), first
        assert torch.equal(micro.attention_mask, expected.attention_mask), first
        assert torch.equal(micro.response_mask, expected.response_mask), first
    joined = streamed.output()
    assert torch.equal(joined.response_ids, out.response_ids) and torch.equal(joined.prompt_ids, out.prompt_ids)
    assert torch.equal(streamed.pass_results(out.response_ids.shape[1])["old"], whole)


def test_a_step_with_rows_missing_is_an_error():
    model = tiny_model(seed=1).eval()
    out = _generated(model, 8)
    streamed = StreamedStep(8, 4, {"old": lambda b: response_logprobs(model, b, 1.0, 4)}, pad_token_id=0)
    streamed.add(0, out.rows(0, 4))
    with pytest.raises(RuntimeError, match="4 of 8 rows"):
        streamed.output()
    with pytest.raises(RuntimeError, match="not run"):
        streamed.pass_results(out.response_ids.shape[1])


@pytest.mark.parametrize("extra, fix", [
    ([], "rollout.placement=standalone"),  # colocated: the batch comes from the trainer's own ranks at once
    (["rollout.placement=standalone"], "rollout.workers >= 2"),  # one worker: one part
])
def test_stream_groups_is_refused_where_no_part_comes_early(extra, fix):
    with pytest.raises(ConfigError, match="rollout.stream_groups") as info:
        load_config(None, [*TINY, *extra, "rollout.stream_groups=true"])
    assert fix in str(info.value)


def test_stream_groups_is_refused_with_a_pipeline():
    cfg = load_config(None, [*TINY, "rollout.placement=standalone", "rollout.workers=2", "rollout.stream_groups=true"])
    ctx = DistContext(ParallelDims(pp=2, dp_replicate=1, dp_shard=1, tp=1), mesh=None)
    with pytest.raises(ConfigError, match="rollout.stream_groups=true does not run with parallel.pp=2"):
        check_rl_layout(cfg, ctx)


def test_data_parallel_shares_run_their_passes_in_lockstep():
    """Two DP shares of 8 rows (micro-batches of 4): a micro-batch runs only once its rows are in on both
    shares, so both ranks, seeing the same arrivals, run the same micro-batch indices at the same arrival."""
    model = tiny_model(seed=1).eval()
    out = _generated(model, 16)
    whole = [response_logprobs(model, RolloutBatch.from_generation(out.rows(q, q + 8), torch.zeros(8, dtype=torch.long),
                                                                   torch.zeros(8)), 1.0, 4) for q in (0, 8)]
    shares = [StreamedStep(8, 4, {"old": lambda b: response_logprobs(model, b, 1.0, 4)}, 0, (0, 8), q) for q in (0, 8)]
    for share in shares:
        share.add(0, out.rows(0, 12))  # share 0 whole, share 1's first micro-batch: both run micro-batch 0
    assert [s.pending for s in shares] == [[4], [4]]
    assert [s.ready(0, 4) for s in shares] == [True, True] and not shares[0].ready(4, 8)
    for share in shares:
        share.add(12, out.rows(12, 16))
    assert [s.pending for s in shares] == [[], []]
    for share, expected in zip(shares, whole):
        assert torch.equal(share.pass_results(out.response_ids.shape[1])["old"][:, : expected.shape[1]], expected)


# Two workers, bf16 worker copies (so the old log-probs are recomputed: a pass to stream) and a KL loss (a
# reference pass); micro-batches of 8 over 16 rows whose parts are whole groups of 4.
BASE = tiny_overrides("data.num_train=64", "actor.ppo_micro_batch_size=8", "actor.ppo_mini_batch_size=8",
                      "actor.lr=1e-3", "data.reward=scalerl.verify:response_length_reward",
                      "rollout.placement=standalone", "rollout.workers=2", "rollout.dtype=bf16",
                      "actor.use_kl_loss=true", "trainer.total_steps=3")
RUNS = {
    "sync": [],
    "one_step_ahead": ["rollout.staleness=1"],
    "dynamic_sampling": ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"],
}


# The update streams too: fp32 workers whose log-probs are the old ones (synchronous, or one step ahead with
# the behaviour policy's), or bf16 workers whose old log-probs are recomputed (on the pre-update copy) and
# weigh the loss by importance weights; mini-batches in row order of one group each, two epochs (the second
# on the whole batch). The worker with the later rows is slowed, so the first rows' part always comes first.
UPDATE_RUNS = {
    "update_sync": [],
    "update_one_step_ahead": ["rollout.staleness=1", "rollout.stale_logprobs=behavior"],
    "update_recomputed": ["rollout.dtype=bf16"],
}
UPDATE_STREAMS = ["rollout.dtype=fp32", "actor.shuffle=false", "actor.ppo_mini_batch_size=4",
                  "actor.ppo_micro_batch_size=4", "actor.ppo_epochs=2"]


def _runs(rank: int, out: str) -> None:
    from scalerl.trainer.rl_trainer import train

    for name, extra in RUNS.items():
        for streamed in (False, True):
            run = f"{out}/{name}_{'streamed' if streamed else 'whole'}"
            cfg = load_config(None, [*BASE, *extra, f"rollout.stream_groups={str(streamed).lower()}",
                                     f"trainer.output_dir={run}"])
            run_case(run, lambda cfg=cfg: train(cfg))
    undo = delay_later_rows(0.5) if rank != 0 else (lambda: None)
    for name, extra in UPDATE_RUNS.items():
        for streamed in (False, True):
            run = f"{out}/{name}_{'streamed' if streamed else 'whole'}"
            cfg = load_config(None, [*BASE, *UPDATE_STREAMS, *extra, f"rollout.stream_groups={str(streamed).lower()}",
                                     f"trainer.output_dir={run}"])
            run_case(run, lambda cfg=cfg: train(cfg))
    undo()
    # Last, as it leaves the group one rank short: worker rank 2 dies inside its second generation (step 2)
    # while the trainer waits for whichever part comes first.
    if rank == 2:
        die_at_generate(2)
    train(load_config(None, [*BASE, "rollout.stream_groups=true", "trainer.dist_timeout_s=120",
                             f"trainer.output_dir={out}/worker_dies_streamed"]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("streamed")
    run_in_group(_runs, 3, str(out), timeout_s=600, may_vanish=(2,))
    return out


def _metrics(run: Path) -> list[dict]:
    skip_if_unsupported(run)
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] > 0]


def _same_training(root: Path, name: str, keys: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """Asserts run ``name``'s streamed and whole-batch runs took 3 steps with equal ``keys`` each step and
    bitwise-equal final weights; returns their metrics (whole, streamed)."""
    whole, streamed = _metrics(root / f"{name}_whole"), _metrics(root / f"{name}_streamed")
    assert len(streamed) == 3
    for key in keys:
        assert [r[key] for r in streamed] == [r[key] for r in whole], key
    a, b = load_file(str(root / f"{name}_whole/final/model.safetensors")), \
        load_file(str(root / f"{name}_streamed/final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    return whole, streamed


@pytest.mark.parametrize("name", list(RUNS))
def test_a_streamed_run_trains_exactly_what_the_whole_batch_run_trains(runs, name):
    whole, streamed = _same_training(runs, name, ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                                  "critic/score/mean", "rollout/logprob_diff/max"))
    # the trainer's work on the first part ran before the second came (two parts: one worker each)
    assert all(r["timing_s/stream_overlap"] > 0 for r in streamed)
    assert all("timing_s/stream_overlap" not in r for r in whole)
    if name != "dynamic_sampling":  # there the passes wait for the filtered batch
        assert all(r["timing_s/old_log_prob"] > 0 and r["timing_s/ref"] > 0 for r in streamed)
    # bf16 workers' log-probs are recomputed by the policy an early optimizer step would change
    assert all(r["perf/stream_early_mini_batches"] == 0 for r in streamed)


UPDATE_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")


@pytest.mark.parametrize("name", list(UPDATE_RUNS))
def test_update_mini_batches_start_before_the_batch_is_whole_and_train_the_same(runs, name):
    """Each step's first part (the first rows: the other worker is slowed) holds at least one whole group, so
    at least one of the step's four mini-batches (one group each) steps before the second part comes; the
    run's losses, gradient norms and final weights equal the whole-batch run's bit for bit."""
    whole, streamed = _same_training(runs, name, UPDATE_KEYS)
    assert all(1 <= r["perf/stream_early_mini_batches"] < 4 for r in streamed)
    if name == "update_recomputed":  # the recompute ran, on the copy, and its importance weights applied
        assert all(r["timing_s/old_log_prob"] > 0 and r["timing_s/old_policy_copy"] > 0 for r in streamed)
        for key in ("rollout/logprob_diff/max", "rollout_corr/weight_mean"):
            assert [r[key] for r in streamed] == [r[key] for r in whole], key
        assert all(r["rollout/logprob_diff/max"] > 0 for r in streamed)
    else:
        assert all("timing_s/old_policy_copy" not in r for r in streamed)


def test_the_update_waits_for_the_whole_batch_where_an_early_step_would_change_what_follows():
    """Each setting that makes an early optimizer step inexact is named (the update then waits)."""

    class Probe:  # `_why_updates_wait` reads only the config, the critic, the rollouts, the plan, the layout
        def __init__(self, *overrides, critic=None, match=True, sharded=False):
            self.cfg = load_config(None, [*BASE, *UPDATE_STREAMS, "rollout.stream_groups=true", *overrides])
            self.critic = critic
            self.rollouts = type("R", (), {"logprobs_match_training_forward": match})()
            a = self.cfg.actor
            self.update_plan = type("P", (), {"mini_batch_size": a.ppo_mini_batch_size})()
            self.dist = type("D", (), {"dp_size": 1, "dims": ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1)})()
            self.policy = type("M", (), {"sharded": sharded})()

    def why(trainer):  # the rollout phase asks its trainer
        return RolloutPhase._why_updates_wait(SimpleNamespace(t=trainer))

    assert why(Probe()) is None
    assert "actor.shuffle" in why(Probe("actor.shuffle=true"))
    assert "critic" in why(Probe(critic=object()))
    assert why(Probe(match=False)) is None  # recomputed old log-probs: on the pre-update copy
    assert "no pre-update copy" in why(Probe(match=False, sharded=True))
    assert "reinforce_plus_plus" in why(Probe("algorithm.adv_estimator=reinforce_plus_plus"))
    assert "filter_groups" in why(Probe("algorithm.filter_groups.enable=true"))
    assert "KL-in-reward" in why(Probe("algorithm.use_kl_in_reward=true"))
    assert "whole batch" in why(Probe("actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=8"))


def test_a_worker_dying_mid_step_is_named_and_its_part_streams_from_the_live_one(runs):
    """Worker rank 2 dies in step 2 while the trainer waits for the first part from either worker: the
    failed receive is retried from the owners one at a time, which names the dead worker and re-issues its
    part to rank 1; the run trains what the unstreamed run with both workers trains (every row's draws are
    its own)."""
    survived, whole = _metrics(runs / "worker_dies_streamed"), _metrics(runs / "sync_whole")
    assert [r["rollout/dead_workers"] for r in survived] == [0.0, 1.0, 1.0]
    assert [r["rollout/last_dead_worker"] for r in survived] == [-1.0, 2.0, 2.0]
    assert [r["critic/score/mean"] for r in survived] == [r["critic/score/mean"] for r in whole]
    assert [r["response_length/mean"] for r in survived] == [r["response_length/mean"] for r in whole]
    a, b = load_file(str(runs / "sync_whole/final/model.safetensors")), \
        load_file(str(runs / "worker_dies_streamed/final/model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


# Two trainer ranks and two workers: FSDP (sharded forwards, so the passes must run in lockstep) with bf16
# workers' log-probs recomputed and a reference pass; and DDP with the update streaming (fp32 workers, row
# order, no balancing: rows stay on their DP rank), the later rows' worker slowed as above; and that DDP run
# with bf16 workers, whose old log-probs each rank recomputes on its copy of the pre-update policy.
DP_RUNS = {
    "dp_fsdp": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
    "dp_update": ["parallel.dp_replicate=2", "parallel.dp_shard=1", "trainer.balance_batch=false",
                  *UPDATE_STREAMS[:2], "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=4"],
}
DP_RUNS["dp_update_recomputed"] = [*DP_RUNS["dp_update"], "rollout.dtype=bf16"]  # on each rank's pre-update copy


def _dp_runs(rank: int, out: str) -> None:
    from scalerl.trainer.rl_trainer import train

    if rank >= 2:
        delay_later_rows(0.5)
    for name, extra in DP_RUNS.items():
        for streamed in (False, True):
            run = f"{out}/{name}_{'streamed' if streamed else 'whole'}"
            cfg = load_config(None, [*BASE, *extra, f"rollout.stream_groups={str(streamed).lower()}",
                                     f"trainer.output_dir={run}"])
            run_case(run, lambda cfg=cfg: train(cfg))


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("streamed_dp")
    run_in_group(_dp_runs, 4, str(out), timeout_s=900)
    return out


@pytest.mark.parametrize("name", list(DP_RUNS))
def test_two_trainer_ranks_stream_and_train_what_the_whole_batch_trains(dp_runs, name):
    """Rank 0 broadcasts each part as it comes; each DP rank scores and passes its share's rows, in lockstep,
    and with the update streaming its first mini-batch steps before the last part comes: losses and the
    final weights equal the unstreamed run's bit for bit."""
    whole, streamed = _same_training(dp_runs, name, UPDATE_KEYS)
    early = [r["perf/stream_early_mini_batches"] for r in streamed]
    assert all(e == 0 for e in early) if name == "dp_fsdp" else all(e >= 1 for e in early)
    if name == "dp_fsdp":
        assert all(r["timing_s/old_log_prob"] > 0 and r["timing_s/ref"] > 0 for r in streamed)
    if name == "dp_update_recomputed":
        assert all(r["timing_s/old_policy_copy"] > 0 for r in streamed)
        assert [r["rollout/logprob_diff/max"] for r in streamed] == [r["rollout/logprob_diff/max"] for r in whole]
