"""One step's metrics combined over ranks as each declares (`scalerl.parallel.metric_reduction`), checked
with a stand-in context whose all-gather hands back given per-rank vectors (the real gather is exercised by
every distributed trainer test)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from scalerl.parallel.distributed import single_process_context
from scalerl.parallel.metric_reduction import reduce_metrics


def _context(per_rank: list[dict[str, float]], dp_size: int | None = None):
    """A context of len(per_rank) ranks whose all-gather returns every rank's values for the same keys."""
    def all_gather(local, over):
        keys = sorted(per_rank[0])
        return torch.tensor([[float(r[k]) for k in keys] for r in per_rank], dtype=torch.float64)

    world = len(per_rank)
    return SimpleNamespace(world_size=world, dp_size=dp_size or world, device=torch.device("cpu"),
                           all_gather=all_gather)


def test_each_declared_reduction_over_ranks():
    ranks = [{"actor/pg_loss": 1.0, "perf/throughput": 10.0, "critic/score/max": 0.5, "timing_s/step": 2.0},
             {"actor/pg_loss": 3.0, "perf/throughput": 30.0, "critic/score/max": 0.9, "timing_s/step": 4.0}]
    out = reduce_metrics(ranks[0], _context(ranks))
    assert out["actor/pg_loss"] == 2.0 and out["perf/throughput"] == 40.0 and out["critic/score/max"] == 0.9
    assert out["timing_s/step"] == 3.0 and out["timing_s/step/max"] == 4.0 and out["timing_s/step/slowest_rank"] == 1


def test_reward_extras_average_over_the_ranks_that_measured_them():
    ranks = [{"reward/extra/acc": 1.0, "reward/extra/len": math.nan, "reward/extra/none": math.nan},
             {"reward/extra/acc": 0.0, "reward/extra/len": 12.0, "reward/extra/none": math.nan}]
    out = reduce_metrics(ranks[0], _context(ranks))
    assert out["reward/extra/acc"] == 0.5
    assert out["reward/extra/len"] == 12.0  # rank 0 had no value: not averaged in as 0 or NaN
    assert "reward/extra/none" not in out  # no rank measured it this step


def test_a_single_process_leaves_out_an_extra_it_did_not_measure():
    out = reduce_metrics({"reward/extra/acc": math.nan, "reward/extra/len": 3.0}, single_process_context())
    assert out == {"reward/extra/len": 3.0}
