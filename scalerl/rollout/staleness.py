"""How far behind the trainer a step's rollouts are: every generated token carries the policy version
(optimizer steps) of the weights that produced it (`GenerationOutput.weight_versions`), the trainer is at
version ``step``, and a sample's staleness is the difference, taken at its oldest token.

With ``rollout.staleness=K`` a sample more than K versions behind is dropped from the loss (its response
mask zeroed, so it adds no tokens to the normalisation) and counted; the request order of
`scalerl.rollout.sources.StandaloneRollouts` keeps every sample within K, so a drop says something went
out of order (a worker that fell behind, a re-issued request). With ``rollout.partial=true`` a response
may span versions (a weight sync landed while it decoded); its oldest token still decides, and
``rollout/partial_fraction`` counts such responses.
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
    valid = response_mask.bool() & (weight_versions >= 0)  # -1: a tool's or user's token, no policy's
    oldest = torch.where(valid, weight_versions.long(), torch.full_like(weight_versions.long(), trainer_version))
    return (trainer_version - oldest.min(dim=-1).values).clamp(min=0)


def check_staleness(weight_versions: torch.Tensor, response_mask: torch.Tensor, trainer_version: int,
                    max_staleness: int) -> StalenessCheck:
    """Which rows a step at ``trainer_version`` keeps, and the metrics (over valid tokens):
    ``rollout/staleness/mean`` and ``/max``, ``rollout/staleness/hist/<k>`` (the share of tokens k versions
    behind, k = 0..K; the same keys every step), ``rollout/dropped_stale`` (rows more than K behind),
    ``rollout/partial_fraction`` (the share of rows whose tokens span more than one version)."""
    valid = response_mask.bool() & (weight_versions >= 0)
    lag = (trainer_version - weight_versions.long()).clamp(min=0)[valid]
    rows = row_staleness(weight_versions, response_mask, trainer_version)
    keep = rows <= max_staleness
    count = max(lag.numel(), 1)
    metrics = {
        "rollout/staleness/mean": float(lag.float().sum()) / count,
        "rollout/staleness/max": float(lag.max()) if lag.numel() else 0.0,
        "rollout/dropped_stale": float((~keep).sum()),
        "rollout/partial_fraction": float(spans_versions(weight_versions, response_mask).sum()) / max(len(keep), 1),
        **{f"rollout/staleness/hist/{k}": float((lag == k).sum()) / count for k in range(max_staleness + 1)},
    }
    return StalenessCheck(keep, metrics)


def spans_versions(weight_versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose generated tokens come from more than one policy version (a partial rollout)."""
    valid = response_mask.bool() & (weight_versions >= 0)
    versions = weight_versions.long()
    lowest = torch.where(valid, versions, torch.iinfo(torch.int64).max).min(dim=-1).values
    highest = torch.where(valid, versions, torch.iinfo(torch.int64).min).max(dim=-1).values
    return valid.any(dim=-1) & (lowest != highest)
