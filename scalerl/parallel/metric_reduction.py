"""One step's metrics combined over ranks as each metric declares (`scalerl.perf.metrics`), in one
all-gather: every rank contributes its vector of values, every rank computes the same reductions."""

from __future__ import annotations

import math

import torch

from scalerl.parallel.distributed import DistContext
from scalerl.perf.metrics import RANKED, reduction_of


def reduce_metrics(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Reduce ``metrics`` (the same keys on every rank) over ranks; see `scalerl.perf.metrics`."""
    keys = sorted(metrics)
    kinds = {k: reduction_of(k) for k in keys}  # an undeclared name fails here, on one rank too
    if ctx.world_size == 1:
        out = dict(metrics)
        for k in keys:
            if kinds[k] == "spread":
                out[f"{k}/max"] = out[f"{k}/min"] = float(metrics[k])
        out.update({f"{k}/slowest_rank": 0.0 for k in RANKED if k in metrics})
        return {k: v for k, v in out.items() if not (kinds.get(k) == "measured_mean" and math.isnan(v))}
    local = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    # Counted in the next step's metrics (this step's were read before this gather).
    gathered = ctx.all_gather(local, over="trainer").view(ctx.world_size, len(keys))
    # Tensor/pipeline peers of a DP rank hold copies of its values: a sum over all ranks counts each DP
    # rank's value world/dp times.
    copies = ctx.world_size / ctx.dp_size
    out: dict[str, float] = {}
    for i, k in enumerate(keys):
        column = gathered[:, i]
        kind = kinds[k]
        if kind == "sum":
            out[k] = float(column.sum() / copies)
        elif kind == "sum_all_ranks":
            out[k] = float(column.sum())
        elif kind == "max":
            out[k] = float(column.max())
        elif kind == "min":
            out[k] = float(column.min())
        elif kind == "measured_mean":
            measured = column[~column.isnan()]
            if len(measured):
                out[k] = float(measured.mean())
        else:  # mean, spread
            out[k] = float(column.mean())
        if kind == "spread":
            out[f"{k}/max"], out[f"{k}/min"] = float(column.max()), float(column.min())
            if k in RANKED:
                out[f"{k}/slowest_rank"] = float(column.argmax())
    return out
