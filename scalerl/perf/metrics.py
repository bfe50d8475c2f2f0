"""How each step metric combines over ranks, declared once per metric name (or family of names).

A distributed run reduces every step's metrics before logging them. Each name declares its reduction
here, so a new metric cannot be silently averaged when it should be summed: an undeclared name is an error
that says where to declare it.

- ``mean``: over data-parallel ranks (tensor/pipeline peers hold the same value), e.g. losses, whose
  per-rank values are each rank's share of the global value scaled by the DP size;
- ``sum``: over data-parallel ranks, e.g. tokens per step (each DP rank processed its own);
- ``sum_all_ranks``: over every rank, e.g. bytes each rank received;
- ``max`` / ``min``: over all ranks;
- ``spread``: timings. The mean over all ranks under the name itself, plus ``<name>/max``,
  ``<name>/min``; for ``timing_s/step`` also ``timing_s/step/slowest_rank``, so a straggler is visible.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

REDUCTIONS = ("mean", "sum", "sum_all_ranks", "max", "min", "spread")

# Exact names first, then glob patterns (first match wins).
METRIC_REDUCTIONS: dict[str, str] = {
    "critic/score/max": "max",
    "critic/score/min": "min",
    "response_length/max": "max",
    "reward/num_failures": "sum",
    "perf/total_num_tokens": "sum",
    "perf/throughput": "sum",
    "perf/max_memory_gb": "max",
    "comm/weight_sync_bytes": "sum_all_ranks",
    "timing_s/*": "spread",
    "comm/bytes/*": "sum_all_ranks",
    # Gradient reduction (scalerl.comm.gradient_reducer): bytes / seconds per rank; the all-reduce choice
    # (1 = hierarchical) and the compression plan are the same on every rank.
    "comm/grad/*": "mean",
    "comm/allreduce/*": "max",
    "comm/compression/*": "mean",
    "actor/*": "mean",
    "critic/*": "mean",
    "sft/*": "mean",
    "val/*": "mean",
    "balance/*": "mean",
    "response_length/*": "mean",
    "perf/*": "mean",
}


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
