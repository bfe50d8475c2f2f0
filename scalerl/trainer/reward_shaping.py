"""A step's rewards and loss mask shaped before its advantages, each off by default: DAPO's overlong
buffer on the scores, KL to the reference in the token rewards (verl's ``algorithm.use_kl_in_reward``,
its coefficient's controller carried by checkpoints), TRL's mask of truncated completions.

The pure functions are `scalerl.algorithms.dapo` / `kl_reward`'s; this is their wiring to a
`RolloutBatch` and the run's config. Truncation is read from the batch itself (a response of
``rollout.max_new_tokens`` tokens that does not end in a stop token), so it holds for any batch a step
assembles, however many generation calls made it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from scalerl.algorithms.dapo import mask_truncated_completions, overlong_penalty
from scalerl.algorithms.kl_reward import apply_kl_penalty, make_kl_controller
from scalerl.core.config import Config
from scalerl.rollout.batch import RolloutBatch


def truncated_rows(batch: RolloutBatch, max_new_tokens: int, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """[B] bool: the responses cut off by the length limit (finish reason "length")."""
    lengths = batch.response_lengths
    last = batch.response_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    stopped = torch.isin(last, torch.tensor(list(stop_token_ids), dtype=last.dtype, device=last.device))
    return (lengths >= max_new_tokens) & ~stopped


class RewardShaping:
    """The run's shaping settings; `needs_reference` says whether the reference model must be built."""

    def __init__(self, cfg: Config, stop_token_ids: Sequence[int],
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        alg = cfg.algorithm
        self.max_new_tokens, self.stop_token_ids = cfg.rollout.max_new_tokens, list(stop_token_ids)
        self.overlong = alg.overlong_buffer if alg.overlong_buffer.enable else None
        self.mask_truncated = cfg.actor.mask_truncated_completions
        self.kl_penalty_kind, self.all_reduce = alg.kl_penalty, all_reduce
        ctrl = alg.kl_ctrl
        self.kl_controller = (make_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
                              if alg.use_kl_in_reward else None)

    @property
    def needs_reference(self) -> bool:
        return self.kl_controller is not None

    def shape_scores(self, batch: RolloutBatch) -> dict[str, float]:
        """The overlong penalty added to ``batch.scores`` in place (before any metric or filter reads them)."""
        if self.overlong is None:
            return {}
        penalty = overlong_penalty(batch.response_lengths, self.max_new_tokens, self.overlong.len,
                                   self.overlong.penalty_factor).to(batch.scores.dtype)
        batch.scores = batch.scores + penalty
        return {"reward/overlong_penalty/mean": float(penalty.mean()),
                "reward/overlong_penalty/share": float((penalty < 0).float().mean())}

    def token_rewards(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The batch's token rewards, minus beta * KL(old || ref) per token with KL in the reward (one
        controller update per step, from the KL over every DP rank's sequences)."""
        rewards = batch.token_rewards()
        if self.kl_controller is None:
            return rewards, {}
        rewards, metrics = apply_kl_penalty(rewards, batch.old_logprobs, batch.ref_logprobs, batch.response_mask,
                                            self.kl_controller, self.kl_penalty_kind, all_reduce=self.all_reduce)
        return rewards, {k: float(v) for k, v in metrics.items()}  # the adaptive coefficient is a NumPy float

    def mask_loss(self, batch: RolloutBatch) -> None:
        """TRL's truncated-completion mask on ``batch.response_mask``, after the advantages (a truncated
        response still counts in its group's baseline, as in TRL): no loss, no tokens in the counts."""
        if self.mask_truncated:
            batch.response_mask = mask_truncated_completions(
                batch.response_mask, truncated_rows(batch, self.max_new_tokens, self.stop_token_ids))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's trainer state keeps: the KL controller's coefficient."""
        return {"kl_ctrl": self.kl_controller.state_dict()} if self.kl_controller is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_controller is not None and "kl_ctrl" in state:
            self.kl_controller.load_state_dict(state["kl_ctrl"])
