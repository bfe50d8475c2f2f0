"""DAPO's dynamic sampling (algorithm.filter_groups) in the RL trainer: groups whose scores do not vary never
reach the update, further batches are drawn until the batch is full or the round limit is reached, the
stream's resume stays exact, and it is off by default; under DP=2 the ranks agree, and standalone workers
(synchronous and one step ahead) run it too."""

import json
from pathlib import Path

import pytest
import torch

from scalerl.core.config import load_config
from scalerl.trainer.rl_trainer import RLTrainer, train
from tests.spawned_group import run_in_group
from tests.tiny import record_step_rows
from tests.trainer.conftest import TINY

# Odd answers score a constant (their groups have no signal and are dropped); even answers score a hash of the
# response, which varies between an untrained model's samples.
PARITY_REWARD = (
    "def score(response, ground_truth):\n"
    "    if int(ground_truth) % 2:\n"
    "        return 0.5\n"
    "    return (sum(map(ord, response)) % 7) / 7\n"
)
HASH_REWARD = "def score(response, ground_truth):\n    return (sum(map(ord, response)) % 7) / 7\n"
CONSTANT_REWARD = "def score(response, ground_truth):\n    return 0.5\n"
FILTER = "algorithm.filter_groups.enable=true"


def _reward(tmp_path: Path, text: str, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return f"data.reward={path}:score"


def _lines(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]


def _recording(cfg):
    """The trainer of ``cfg`` and, per step, the batch it updated on and the rows it drew them from."""
    seen: list[tuple] = []
    rows: list[list[dict]] = []
    trainer = RLTrainer.from_config(cfg, on_batch=lambda batch: seen.append((batch, rows[-1])))
    record_step_rows(trainer, rows)
    return trainer, seen


def _groups_vary(batch, n: int) -> bool:
    scores = batch.scores.view(-1, n)
    return bool((scores.max(1).values > scores.min(1).values).all())


def test_dropped_groups_never_reach_the_update_and_more_batches_are_drawn(tiny_config, tmp_path):
    trainer, seen = _recording(tiny_config(FILTER, _reward(tmp_path, PARITY_REWARD, "parity")))
    trainer.fit()
    rows = _lines(trainer.output_dir)
    assert len(seen) == len(rows) == 3
    for (batch, step_rows), metrics in zip(seen, rows):
        assert len(batch) == 4 * 4 and len(step_rows) == 4  # trainer.batch_size groups of rollout.n
        assert all(int(r["ground_truth"]) % 2 == 0 for r in step_rows)  # the constant groups were dropped
        assert _groups_vary(batch, 4)
        assert metrics["filter/batch_full"] == 1 and metrics["filter/trained_groups"] == 4
        assert metrics["filter/kept_groups"] + metrics["filter/dropped_groups"] == 4 * metrics["filter/gen_batches"]
        assert metrics["filter/kept_groups"] >= 4
    assert any(m["filter/gen_batches"] >= 2 and m["filter/dropped_groups"] > 0 for m in rows)
    # Every round drew a further batch from the stream; nothing was prefetched past the last step.
    assert trainer.stream.position == 4 * sum(m["filter/gen_batches"] for m in rows)


def test_at_the_round_limit_the_step_trains_on_what_was_kept(tiny_config, tmp_path):
    trainer, seen = _recording(tiny_config(FILTER, "algorithm.filter_groups.max_num_gen_batches=1",
                                           "trainer.total_steps=4", _reward(tmp_path, PARITY_REWARD, "parity")))
    drawn = []
    draw = trainer.stream.next_batch
    trainer.stream.next_batch = lambda: drawn.append(draw()) or drawn[-1]
    trainer.fit()
    rows = _lines(trainer.output_dir)
    for (batch, step_rows), metrics, batch_rows in zip(seen, rows, drawn):
        even = [r for r in batch_rows if int(r["ground_truth"]) % 2 == 0]
        assert metrics["filter/gen_batches"] == 1
        assert step_rows == even and len(batch) == 4 * len(even)
        assert metrics["filter/trained_groups"] == len(even)
        assert metrics["filter/batch_full"] == float(len(even) == 4)
    assert any(m["filter/batch_full"] == 0 for m in rows)  # a short batch happened and was said so


def test_no_signal_at_the_limit_trains_the_first_batch_unfiltered(tiny_config, tmp_path):
    trainer, seen = _recording(tiny_config(FILTER, "algorithm.filter_groups.max_num_gen_batches=2",
                                           _reward(tmp_path, CONSTANT_REWARD, "constant")))
    trainer.fit()
    rows = _lines(trainer.output_dir)
    assert all(m["filter/gen_batches"] == 2 and m["filter/kept_groups"] == 0 and m["filter/batch_full"] == 0
               for m in rows)
    assert all(len(batch) == 16 for batch, _ in seen)
    assert trainer.stream.position == 3 * 2 * 4


def test_off_by_default_and_on_without_drops_trains_the_same(tiny_config, tmp_path):
    assert not load_config(None, TINY).algorithm.filter_groups.enable
    reward = _reward(tmp_path, HASH_REWARD, "hash")
    off = RLTrainer.from_config(tiny_config(reward, f"trainer.output_dir={tmp_path / 'off'}"))
    off.fit()
    on = RLTrainer.from_config(tiny_config(reward, FILTER, f"trainer.output_dir={tmp_path / 'on'}"))
    on.fit()
    assert all(not k.startswith("filter/") for r in _lines(off.output_dir) for k in r)
    on_rows = _lines(on.output_dir)
    assert all(r["filter/dropped_groups"] == 0 and r["filter/gen_batches"] == 1 for r in on_rows)
    assert off.stream.position == on.stream.position == 3 * 4
    for (name, a), (_, b) in zip(off.policy.model.state_dict().items(), on.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    for ra, rb in zip(_lines(off.output_dir), on_rows):
        assert ra["actor/pg_loss"] == rb["actor/pg_loss"] and ra["critic/score/mean"] == rb["critic/score/mean"]


def test_resume_equals_the_uninterrupted_run(tiny_config, tmp_path):
    reward = _reward(tmp_path, PARITY_REWARD, "parity")
    straight = RLTrainer.from_config(tiny_config(FILTER, reward, "trainer.total_steps=4",
                                                 f"trainer.output_dir={tmp_path / 'a'}"))
    straight.fit()
    RLTrainer.from_config(tiny_config(FILTER, reward, "trainer.total_steps=2", "trainer.save_every=2",
                                      f"trainer.output_dir={tmp_path / 'b'}")).fit()
    resumed = RLTrainer.from_config(tiny_config(FILTER, reward, "trainer.total_steps=4", "trainer.resume=auto",
                                                f"trainer.output_dir={tmp_path / 'b'}"))
    assert resumed.step == 2
    resumed.fit()
    assert resumed.stream.position == straight.stream.position
    for (name, a), (_, b) in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    a_rows, b_rows = _lines(tmp_path / "a"), _lines(tmp_path / "b")
    assert any(r["filter/gen_batches"] >= 2 for r in a_rows[:2])  # the saved position is past extra draws
    for ra, rb in zip(a_rows, b_rows):
        for key in ("actor/pg_loss", "critic/score/mean", "filter/gen_batches", "filter/kept_groups"):
            assert ra[key] == rb[key], (ra["step"], key)


# ----------------------------------------------------------------------------- two processes (one group)
def _spawned_runs(rank: int, out: str, reward: str) -> dict:
    base = [*TINY, FILTER, reward]
    cfg = load_config(None, [*base, "parallel.dp_replicate=2", f"trainer.output_dir={out}/dp2"])
    trainer, seen = _recording(cfg)
    trainer.fit()
    dp2 = {"lengths": [len(b) for b, _ in seen], "vary": [_groups_vary(b, 4) for b, _ in seen],
           "rows": [[r["ground_truth"] for r in rows] for _, rows in seen], "position": trainer.stream.position}
    for name, extra in {"standalone": ["rollout.placement=standalone"],
                        "async": ["rollout.placement=standalone", "rollout.staleness=1", "trainer.total_steps=4",
                                  "trainer.save_every=2"],
                        "async_first": ["rollout.placement=standalone", "rollout.staleness=1",
                                        "trainer.total_steps=2", "trainer.save_every=2"]}.items():
        train(load_config(None, [*base, *extra, f"trainer.output_dir={out}/{name}"]))
    # A pipeline's schedule takes whole mini-batches (8 rows: 4 groups of 2): short batches keep 4 of the 8 groups.
    train(load_config(None, [*base, "parallel.pp=2", "rollout.n=2", "trainer.batch_size=8",
                             "algorithm.filter_groups.max_num_gen_batches=1", "trainer.total_steps=4",
                             f"trainer.output_dir={out}/pipeline"]))
    train(load_config(None, [*base, "rollout.placement=standalone", "rollout.staleness=1", "trainer.total_steps=4",
                             "trainer.resume=auto", f"trainer.output_dir={out}/async_first"]))
    return dp2


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic_sampling")
    reward = _reward(out, PARITY_REWARD, "parity")
    train(load_config(None, [*TINY, FILTER, reward, f"trainer.output_dir={out}/colocated"]))
    return out, run_in_group(_spawned_runs, 2, str(out), reward, timeout_s=900)


def test_data_parallel_ranks_agree_on_the_kept_groups(spawned):
    out, ranks = spawned
    rows = _lines(out / "dp2")
    assert ranks[0]["lengths"] == ranks[1]["lengths"] == [8] * 3  # 2 groups of 4 samples per rank each step
    assert all(all(r["vary"]) for r in ranks)
    assert ranks[0]["position"] == ranks[1]["position"] == 4 * sum(m["filter/gen_batches"] for m in rows)
    for rank in ranks:
        assert all(int(g) % 2 == 0 for step in rank["rows"] for g in step)
    assert all(m["filter/trained_groups"] == 4 and m["filter/batch_full"] == 1 for m in rows)


def test_standalone_workers_filter_as_colocated_generation_does(spawned):
    out, _ = spawned
    colocated, standalone = _lines(out / "colocated"), _lines(out / "standalone")
    for key in ("critic/score/mean", "filter/gen_batches", "filter/kept_groups", "filter/dropped_groups"):
        assert [r[key] for r in standalone] == [r[key] for r in colocated], key


def test_one_step_async_filters_and_saves_the_position_after_every_draw(spawned):
    """The checkpoint after step 2 holds the stream after step 2's rounds and before step 3's prefetch (which a
    resumed run draws and generates again, with the saved weights rather than the one-step-stale ones, so its
    weights are not compared: asynchronous resume regenerates the prefetched step with or without filtering)."""
    out, _ = spawned
    rows = _lines(out / "async")
    assert len(rows) == 4 and all(r["filter/batch_full"] == 1 for r in rows)
    assert any(r["filter/gen_batches"] >= 2 for r in rows)
    for run in ("async", "async_first"):
        state = json.loads((out / run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
        assert state["data"]["position"] == 4 * sum(r["filter/gen_batches"] for r in rows[:2]), run
    resumed = _lines(out / "async_first")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and all(r["filter/batch_full"] == 1 for r in resumed)
    assert [r["filter/gen_batches"] for r in resumed[:2]] == [r["filter/gen_batches"] for r in rows[:2]]


def test_a_pipeline_trains_short_batches_it_can_split(spawned):
    out, _ = spawned
    rows = _lines(out / "pipeline")
    assert len(rows) == 4 and all(r["filter/gen_batches"] == 1 for r in rows)
    for r in rows:  # whole mini-batches of kept groups; fewer than one: the unfiltered batch
        kept = r["filter/kept_groups"]
        assert r["filter/trained_groups"] == (4 if 4 <= kept < 8 else 8), r
    assert any(r["filter/batch_full"] == 0 for r in rows)
