"""Resume under Ulysses sequence parallelism: a GRPO run at ``parallel.sp=2`` (world 2, one data-parallel
replica whose sequences are split over both ranks) saved at step 2 and resumed ends bitwise where the
uninterrupted run ends, and its checkpoint is the distributed one of a two-rank world."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.spawned_group import run_in_group

LAYOUT = ["parallel.dp_replicate=1", "parallel.sp=2"]


def _train_straight_and_resumed(rank, out):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train
    from scalerl.verify import verification_overrides

    base = [o for o in verification_overrides(4) if not o.startswith("trainer.total_steps")]
    run = lambda d, *extra: train(load_config(None, [*base, *LAYOUT, f"trainer.output_dir={out}/{d}", *extra]))  # noqa: E731
    run("straight", "trainer.total_steps=4")
    run("resumed", "trainer.total_steps=2", "trainer.save_every=2")
    run("resumed", "trainer.total_steps=4", "trainer.resume=auto")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp-resume")
    run_in_group(_train_straight_and_resumed, 2, str(out), timeout_s=900)
    return out


def test_resumed_sp_run_matches_uninterrupted(runs):
    straight = load_file(str(runs / "straight" / "final" / "model.safetensors"))
    resumed = load_file(str(runs / "resumed" / "final" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    rows = [json.loads(x) for x in (runs / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    straight_rows = [json.loads(x) for x in (runs / "straight" / "metrics.jsonl").read_text().splitlines()]
    for before, after in zip(straight_rows[3:], rows[3:]):  # the steps after the resume
        assert after["actor/pg_loss"] == before["actor/pg_loss"]
        assert after["comm/bytes/sequence"] == before["comm/bytes/sequence"] > 0
    meta = json.loads(next((runs / "resumed" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["distributed"]["world_size"] == 2
