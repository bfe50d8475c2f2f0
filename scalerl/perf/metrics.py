"""How each step metric combines over ranks, declared once per metric name (or family of names).

A distributed run reduces every step's metrics before logging them. Each name declares its reduction
here, so a new metric cannot be silently averaged when it should be summed: an undeclared name is an error
that says where to declare it.

- ``mean``: over data-parallel ranks (tensor/pipeline peers hold the same value), e.g. losses, whose
  per-rank values are each rank's share of the global value scaled by the DP size;
- ``sum``: over data-parallel ranks, e.g. tokens per step (each DP rank processed its own);
- ``sum_all_ranks``: over every rank, e.g. bytes each rank received;
- ``max`` / ``min``: over all ranks;
- ``measured_mean``: the mean over the ranks that measured it (a rank that did not reports NaN), left out
  when none did, e.g. ``reward/extra/*``, the numbers a reward function returns beside its score, which a
  step whose every call failed does not have;
- ``spread``: timings. The mean over all ranks under the name itself, plus ``<name>/max``,
  ``<name>/min``; for the names in ``RANKED`` also ``<name>/slowest_rank``, so a straggler is visible.
  ``timing_s/busy`` is a rank's own work (the step minus its time blocked in collectives), which tells a
  slow rank from the ranks waiting for it; ``perf/update_tokens`` (tokens a rank updates on) spreads the
  same way, so the token imbalance over data-parallel ranks is ``/max`` over the mean.

``health/*`` (the online monitor's level per leaf of the doctor's tree, `scalerl.health`) is computed
from already-reduced metrics, the same on every rank.

``comm/bytes/*`` (bytes each rank sent, `scalerl.comm.counting.accounting`) is the mean per rank, not the sum:
divided by the step time it is the rate one rank's link must carry, and it stays comparable across world
sizes (a ring all-reduce sends 2(n-1)/n x S per rank, nearly constant in n; the sum grows with n). The
job's total is the mean x world size; ``comm/bytes/total`` is a spread, so ``/max`` shows the busiest rank.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

REDUCTIONS = ("mean", "sum", "sum_all_ranks", "max", "min", "measured_mean", "spread")

# Exact names first, then glob patterns (first match wins).
METRIC_REDUCTIONS: dict[str, str] = {
    "critic/score/max": "max",
    "critic/score/min": "min",
    "response_length/max": "max",
    "reward/num_failures": "sum",
    "reward/extra/*": "measured_mean",
    "reward/overlong_penalty/*": "mean",  # DAPO's overlong buffer (scalerl/trainer/reward_shaping.py), equal shares
    "perf/total_num_tokens": "sum",
    "perf/throughput": "sum",
    "perf/max_memory_gb": "max",
    "comm/weight_sync_bytes": "sum_all_ranks",
    "perf/update_tokens": "spread",
    "health/*": "max",
    "rollout/logprob_diff/max": "max",
    "rollout/staleness/max": "max",  # scalerl/rollout/staleness.py: samples dropped (sum) and lag per rank
    "rollout/dropped_stale": "sum",
    "rollout_corr/*": "mean",  # scalerl/algorithms/importance.py: per-rank shares, equal token counts assumed
    "comm/bytes/total": "spread",
    "timing_s/*": "spread",
    "comm/bytes/*": "mean",
    # Weight sync (scalerl/comm/weights/sender.py): the source rank holds the values, the other trainer ranks
    # report 0, so the max over ranks is the source's figure. bytes/full_bytes/changed_fraction/
    # static_tensors/dynamic_tensors/resyncs/full_push/peak_bucket_bytes, and the lossy mode's
    # deferred_tensors/max_deviation/max_staleness.
    "weight_sync/*": "max",
    # Gradient reduction (scalerl.comm.gradients.reducer): bytes / seconds per rank; the all-reduce choice
    # (1 = hierarchical) and the compression plan are the same on every rank.
    "comm/grad/*": "mean",
    "comm/allreduce/*": "max",
    "comm/compression/*": "mean",
    # Dynamic sampling (scalerl/trainer/dynamic_sampling.py): decided over DP, the same on every rank.
    "filter/*": "max",
    "actor/*": "mean",
    "critic/*": "mean",
    "sft/*": "mean",
    # MoE router (scalerl.models.moe.RouterAuxLoss): already reduced over DP, the same on every rank.
    "moe/*": "max",
    "val/*": "mean",
    "balance/*": "mean",
    "rollout/*": "mean",
    "distill/*": "mean",  # scalerl/algorithms/distillation.py: already over every rank's tokens (all-reduced sums)
    # scalerl/rollout/agent/loop.py's agent_metrics: counts over the batch, turns per episode
    "agent/turns/max": "max",
    "agent/turns/mean": "mean",
    "agent/env_time_share": "mean",
    "agent/tool_s/*": "max",  # a tool's mean seconds per call: the slowest rank's, which sets the pace
    "agent/*": "sum",
    "response_length/*": "mean",
    "perf/*": "mean",
}

# Spread metrics whose slowest rank is reported as ``<name>/slowest_rank``.
RANKED = ("timing_s/step", "timing_s/busy")


class UndeclaredMetricError(KeyError):
    """A metric name without a declared reduction."""


def reduction_of(name: str) -> str:
    """The declared reduction of metric ``name``."""
    if name in METRIC_REDUCTIONS:
        return METRIC_REDUCTIONS[name]
    for pattern, reduction in METRIC_REDUCTIONS.items():
        if "*" in pattern and fnmatchcase(name, pattern):
            return reduction
    raise UndeclaredMetricError(
        f"metric {name!r} has no declared reduction over ranks; add it to METRIC_REDUCTIONS in "
        f"scalerl/perf/metrics.py (one of {', '.join(REDUCTIONS)})"
    )
