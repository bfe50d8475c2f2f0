"""KL to the reference policy as a reward penalty (verl's `algorithm.use_kl_in_reward`): the penalised
token rewards and the fixed / adaptive controllers of its coefficient (verl `apply_kl_penalty`,
`FixedKLController`, `AdaptiveKLController`; the adaptive one is Ziegler et al., arXiv 1909.08593)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from scalerl.algorithms.kl import kl_penalty
from scalerl.algorithms.masked import masked_mean

KL_CONTROLLER_TYPES = ("fixed", "adaptive")


class FixedKLController:
    """A constant coefficient ``value`` = kl_coef; `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Moves ``value`` toward the coefficient that keeps the KL at ``target_kl``:
        e = clip(current_kl / target_kl - 1, -0.2, 0.2),   value <- value * (1 + e * n_steps / horizon)
    with n_steps the number of sequences the KL was measured on."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        super().__init__(init_kl_coef)
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def make_kl_controller(kind: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1,
                       horizon: int = 10000) -> FixedKLController:
    """verl `get_kl_controller` from `algorithm.kl_ctrl` (type, kl_coef, target_kl, horizon; verl's defaults)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; choose one of {KL_CONTROLLER_TYPES}")


@torch.no_grad()
def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, controller: FixedKLController, kl_penalty_kind: str = "kl",
                     all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards minus beta * KL, then one controller update (verl `apply_kl_penalty`).

        kld     = kl_penalty(old_log_prob, ref_log_prob, kind) * m
        rewards = scores - beta * kld,   beta = controller.value before the update
        current_kl = mean over sequences of (masked mean of kld over the sequence's tokens)
        controller.update(current_kl, n_steps = number of sequences)
    With ``all_reduce`` (SUM over DP ranks) current_kl and n_steps are the global batch's, so every rank
    updates its controller identically. Metrics: actor/reward_kl_penalty, actor/reward_kl_penalty_coeff.
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kld
    sums = torch.stack([masked_mean(kld, mask, dim=-1).sum(), torch.tensor(float(kld.shape[0]), dtype=kld.dtype)])
    if all_reduce is not None:
        sums = all_reduce(sums)
    current_kl = (sums[0] / sums[1]).item()
    controller.update(current_kl=current_kl, n_steps=int(sums[1].item()))
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
