"""DAPO's batch shaping (arXiv 2503.14476; verl's `recipe/dapo` and `DAPORewardManager`) and TRL's
truncation mask: which prompt groups dynamic sampling keeps, the overlong-buffer length penalty, and
the mask that drops truncated completions from the loss."""

from __future__ import annotations

import torch

from scalerl.algorithms.advantages import GroupIds, group_index


@torch.no_grad()
def groups_with_signal(metric_values: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, int, int]:
    """Dynamic sampling's filter: keep the groups whose per-sample metric varies, and groups of one.

    Returns (keep [B] bool per sample, kept_groups, dropped_groups). A group is dropped when all its
    samples have the same metric value (zero variance: every GRPO advantage in it is 0). verl's rule is
    ``np.std(values) > 0 or len(values) == 1``; equal values are tested exactly here, so a group of equal
    non-representable floats (0.1, 0.1, 0.1), whose np.std is 1e-17 from rounding, is dropped, not kept.
    """
    values = torch.as_tensor(metric_values).reshape(-1).to(torch.float64)
    codes = group_index(group_ids, device=values.device)
    if codes.numel() != values.numel():
        raise ValueError(f"group_ids has {codes.numel()} entries for {values.numel()} metric values")
    num_groups = int(codes.max().item()) + 1 if codes.numel() else 0
    top = torch.full((num_groups,), float("-inf"), dtype=values.dtype).scatter_reduce(0, codes, values, "amax")
    bottom = torch.full((num_groups,), float("inf"), dtype=values.dtype).scatter_reduce(0, codes, values, "amin")
    sizes = torch.bincount(codes, minlength=num_groups)
    kept = (top > bottom) | (sizes == 1)
    return kept[codes], int(kept.sum().item()), int((~kept).sum().item())


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl `reward.overlong_buffer.len` / `.penalty_factor`), per sample:
        expected = max_response_length - buffer_len
        penalty  = min(-(length - expected) / buffer_len * penalty_factor, 0)
    0 up to ``expected`` tokens, then linear down to -penalty_factor at ``max_response_length``; added to
    the score."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer len must be in (0, max_response_length={max_response_length}], "
                         f"got {buffer_len}")
    exceed = response_lengths.to(torch.float64) - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def mask_truncated_completions(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """TRL's ``mask_truncated_completions``: zero the mask of every response cut off by the length limit
    (``truncated`` [B] bool), so it contributes neither loss nor token counts."""
    return response_mask * (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)
