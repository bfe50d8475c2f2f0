"""How far behind the trainer a step's rollouts are: every generated token carries the policy version
(optimizer steps) of the weights that produced it (`GenerationOutput.weight_versions`), the trainer is at
version ``step``, and a sample's staleness is the difference, taken at its oldest token.

With ``rollout.staleness=K`` a sample more than K versions behind is dropped from the loss (its response
mask zeroed, so it adds no tokens to the normalisation) and counted; the request order of
`scalerl.rollout.sources.StandaloneRollouts` keeps every sample within K, so a drop says something went
out of order (a worker that fell behind, a re-issued request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StalenessCheck:
    keep: torch.Tensor  # [B] bool: rows within the bound
    metrics: dict[str, float]


def row_staleness(weight_versions: torch.Tensor, response_mask: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """[B] versions each row lags the trainer by, at its oldest generated token (0 for an empty response)."""
    valid = response_mask.bool()
    oldest = torch.where(valid, weight_versions.long(), torch.full_like(weight_versions.long(), trainer_version))
    return (trainer_version - oldest.min(dim=-1).values).clamp(min=0)


def check_staleness(weight_versions: torch.Tensor, response_mask: torch.Tensor, trainer_version: int,
                    max_staleness: int) -> StalenessCheck:
    """Which rows a step at ``trainer_version`` keeps, and the metrics (over valid tokens):
    ``rollout/staleness/mean`` and ``/max``, ``rollout/staleness/hist/<k>`` (the share of tokens k versions
    behind, k = 0..K; the same keys every step), ``rollout/dropped_stale`` (rows more than K behind)."""
    valid = response_mask.bool()
    lag = (trainer_version - weight_versions.long()).clamp(min=0)[valid]
    rows = row_staleness(weight_versions, response_mask, trainer_version)
    keep = rows <= max_staleness
    count = max(lag.numel(), 1)
    metrics = {
        "rollout/staleness/mean": float(lag.float().sum()) / count,
        "rollout/staleness/max": float(lag.max()) if lag.numel() else 0.0,
        "rollout/dropped_stale": float((~keep).sum()),
        **{f"rollout/staleness/hist/{k}": float((lag == k).sum()) / count for k in range(max_staleness + 1)},
    }
    return StalenessCheck(keep, metrics)
