"""The matrix: strategy names to layouts, cells and the ones skipped with a reason, each cell's overrides."""

from __future__ import annotations

import pytest

from scalerl.bench.matrix import BenchMatrix, NotApplicable, strategy_layout
from scalerl.core.config import load_config


@pytest.mark.parametrize("name, world, rpn, expected", [
    ("ddp", 4, 2, {"dp_replicate": 4, "dp_shard": 1, "tp": 1, "pp": 1}),
    ("fsdp", 4, 2, {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "pp": 1}),
    ("hsdp", 4, 2, {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}),  # shard in a node, replicate across
    ("hsdp", 8, 4, {"dp_replicate": 2, "dp_shard": 4, "tp": 1, "pp": 1}),
    ("tp2+ddp", 4, 2, {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1}),
    ("tp2+hsdp", 8, 4, {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "pp": 1}),
    ("pp2+fsdp", 4, 1, {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}),
    ("tp", 2, 2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}),
    ("pp", 4, 1, {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 4}),
    ("tp2+pp2", 4, 2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 2}),
])
def test_strategy_layouts(name, world, rpn, expected):
    assert strategy_layout(name, world, rpn) == expected


def test_bad_strategies():
    for bad, match in (("zero3", "not one of"), ("ddp+fsdp", "at most"), ("ddp4", "takes no size"),
                       ("tp+ddp", "give tp a size")):
        with pytest.raises(ValueError, match=match):
            strategy_layout(bad, 4, 1)
    with pytest.raises(NotApplicable, match="multiple of 2"):
        strategy_layout("tp2+ddp", 3, 1)
    with pytest.raises(NotApplicable, match=r"add \+ddp"):
        strategy_layout("tp2", 4, 1)


def test_cells_calibration_first_and_skipped_with_reasons():
    matrix = BenchMatrix(strategies=["ddp", "tp2+ddp"], nodes=[1, 2, 3], rates_mbit=[100, 1000])
    cells, skipped = matrix.cells()
    assert cells[0].calibration and cells[0].world == 1
    ids = [c.id for c in cells]
    assert "ddp|1x1|0M|none|default|colocated" in ids  # one node: no link, one rate
    assert "ddp|3x1|100M|none|default|colocated" in ids and "ddp|3x1|1000M|none|default|colocated" in ids
    assert len(ids) == len(set(ids))
    assert any("tp2+ddp|3x1" in s["id"] and "multiple of 2" in s["reason"] for s in skipped)
    assert any("tp2+ddp|1x1" in s["id"] for s in skipped)


def test_weak_scaling_batch_and_variant_overrides():
    matrix = BenchMatrix(strategies=["ddp"], nodes=[2], ranks_per_node=2, compression=["none", "fp16"],
                         allreduce=["default", "hierarchical"], weight_sync=["colocated", "delta"],
                         overrides=["rollout.max_new_tokens=8"])
    cells, _ = matrix.cells()
    by_id = {c.id: c for c in cells}
    plain = matrix.cell_overrides(by_id["ddp|2x2|1000M|none|default|colocated"], samples_per_prompt=4)
    assert "trainer.batch_size=16" in plain and "actor.ppo_mini_batch_size=32" in plain  # 4 prompts x 4 DP ranks
    assert not any(o.startswith("comm.") for o in plain)  # plain cells set no comm key: they run on any scalerl
    assert plain[-1] == "rollout.max_new_tokens=8"  # the user's overrides come last and win
    variant = matrix.cell_overrides(by_id["ddp|2x2|1000M|fp16|hierarchical|delta"], samples_per_prompt=4)
    assert {"comm.gradient_compression=fp16", "comm.allreduce=hierarchical", "rollout.placement=standalone",
            "rollout.workers=2", "weight_sync.mode=delta"} <= set(variant)
    worker_cell = by_id["ddp|2x2|1000M|fp16|hierarchical|delta"]
    assert worker_cell.total_nodes == 3 and worker_cell.devices == 6  # the workers' node sits behind the link
    one_node = BenchMatrix(strategies=["ddp"], nodes=[1], ranks_per_node=2, weight_sync=["full"]).cells()[0][1]
    assert one_node.total_nodes == 1 and one_node.launch_ranks_per_node == 4  # on one node: more local ranks
    cfg = load_config(None, plain[:-1] + ["trainer.output_dir=/tmp/x"])  # a plain cell's config is valid
    assert cfg.parallel.dp_replicate == 4 and cfg.trainer.total_steps == matrix.warmup + matrix.steps


def test_matrix_checks_and_round_trip():
    with pytest.raises(ValueError, match="weight-sync"):
        BenchMatrix(weight_sync=["lazy"]).check()
    with pytest.raises(ValueError, match="steps"):
        BenchMatrix(steps=0).check()
    with pytest.raises(ValueError, match="unknown matrix key"):
        BenchMatrix.from_dict({"strategy": ["ddp"]})
    matrix = BenchMatrix(strategies=["fsdp"], nodes=[1, 4])
    assert BenchMatrix.from_dict(matrix.to_dict()) == matrix
