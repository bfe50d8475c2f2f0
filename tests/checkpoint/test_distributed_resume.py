"""Distributed checkpoints: a run resumed at step 2 ends where an uninterrupted run ends, per layout."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.spawned_group import run_in_group

LAYOUTS = {"ddp": ["parallel.dp_replicate=2"], "fsdp": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
           "pp": ["parallel.dp_replicate=1", "parallel.pp=2"]}


def _train_straight_and_resumed(rank, out):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train
    from scalerl.verify import verification_overrides

    base = [o for o in verification_overrides(4) if not o.startswith("trainer.total_steps")]
    for name, layout in LAYOUTS.items():
        run = lambda d, *extra: train(load_config(None, [*base, *layout, f"trainer.output_dir={out}/{name}-{d}", *extra]))  # noqa: E731
        run("straight", "trainer.total_steps=4")
        run("resumed", "trainer.total_steps=2", "trainer.save_every=2")
        run("resumed", "trainer.total_steps=4", "trainer.resume=auto")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    run_in_group(_train_straight_and_resumed, 2, str(out))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resumed_run_matches_uninterrupted(runs, layout):
    straight = load_file(str(runs / f"{layout}-straight" / "final" / "model.safetensors"))
    resumed = load_file(str(runs / f"{layout}-resumed" / "final" / "model.safetensors"))
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    rows = [json.loads(x) for x in (runs / f"{layout}-resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    meta = json.loads(next((runs / f"{layout}-resumed" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["distributed"]["world_size"] == 2 and any(Path(f).name.endswith(".distcp") for f in meta["files"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_steps_report_their_communication(runs, layout):
    # The trainer's step metrics carry the per-rank byte accounting (scalerl.comm.counting.accounting).
    rows = [json.loads(x) for x in (runs / f"{layout}-straight" / "metrics.jsonl").read_text().splitlines()]
    step = rows[2]
    assert step["step"] == 2
    sent = {kind: step[f"comm/bytes/{kind}"] for kind in ("grad", "param", "tp", "pp", "rebalance", "weight_sync",
                                                          "metrics", "rollout")}
    assert (sent["rollout"] > 0) <= (layout == "pp")  # only pipeline ranks exchange generated rows
    assert sent["grad"] > 0 and sent["metrics"] > 0 and sent["tp"] == 0  # tied embeddings: PP sums their grads
    assert (sent["param"] > 0) == (layout == "fsdp")  # all-gathers: FSDP only
    assert (sent["pp"] > 0) == (sent["weight_sync"] > 0) == (layout == "pp")
    assert (sent["rebalance"] > 0) == (layout != "pp")  # rollouts move between DP ranks
    assert step["comm/bytes/total"] == pytest.approx(sum(sent.values()))
    assert step["comm/bytes/total/max"] >= step["comm/bytes/total/min"] > 0
    assert step["timing_s/comm/grad"] > 0


@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_distributed_checkpoint_exports_to_transformers(runs, layout, tmp_path):
    """`scalerl export` of a sharded and of a pipeline checkpoint equals the model the run exported itself."""
    pytest.importorskip("transformers")
    from scalerl.cli import main
    from tests.checkpoint.hf_compare import assert_loads_in_transformers

    assert main(["export", str(runs / f"{layout}-resumed"), str(tmp_path / "hf")]) == 0
    assert_loads_in_transformers(tmp_path / "hf", runs / f"{layout}-resumed" / "final")
