"""`ADVANTAGE_ESTIMATORS`: verl's advantage estimators by verl's names, all called the same way.

    inputs = AdvantageInputs(token_level_rewards, response_mask, index=group_ids, values=..., gamma=..., ...)
    advantages, returns = get_advantage_estimator(cfg.algorithm.adv_estimator)(inputs)

Each entry is an `AdvantageEstimator`: callable on `AdvantageInputs`, with the inputs it needs beyond
rewards and mask (``needs``: "values" means a critic, "reward_baselines" a greedy rollout per prompt,
"reward_components" each reward component's score per sample (gdpo), "old_log_probs" / "sum_pi_squared" the
old policy's per-token log-probs and sum_v pi_v^2 (the optimal token baselines)) and a one-line
description. verl's `*_vectorized` entries are their own entries: they are verl's vectorized formulas, which
differ from the loop versions at the edges (groups of one, near-constant groups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from scalerl.algorithms import group_advantages as grp
from scalerl.algorithms import token_baselines as otb
from scalerl.algorithms.advantages import (
    GroupIds,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
)

Advantages = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything any estimator reads. Tensors are [B, T] (``reward_baselines`` [B]); verl's names and defaults.

    ``index``: group id per sample (prompt uid); ``values``: critic values (gae); ``reward_baselines``: the
    greedy response's reward per sample (remax); ``all_reduce``: SUM over data-parallel ranks, so the
    estimators that whiten over the batch (gae, reinforce_plus_plus[_baseline], gdpo) or count it (gpg) use
    the global batch when it is sharded. For verl 0.9.1's newer estimators: ``reward_components`` [K, B], each
    reward component's score per sample, and ``reward_weights`` [K] (gdpo; verl's algorithm.gdpo_reward_keys /
    gdpo_reward_weights); ``old_log_probs`` and ``sum_pi_squared`` [B, T], the old policy's log-prob of each
    sampled token and sum_v pi_v^2 over the vocabulary at that position (the optimal token baselines; verl's
    actor.calculate_sum_pi_squared); ``rollout_is_weights`` [B, T], the rollout importance weights those
    baselines fold in when the trainer has them.
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: GroupIds | None = None
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    reward_components: torch.Tensor | None = None
    reward_weights: tuple[float, ...] | None = None
    old_log_probs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registry entry: ``estimator(inputs) -> (advantages, returns)``, both [B, T]."""

    name: str
    compute: Callable[[AdvantageInputs], Advantages]
    description: str
    needs: tuple[str, ...] = ("index",)

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        missing = [field for field in self.needs if getattr(inputs, field) is None]
        if missing:
            raise ValueError(f"advantage estimator {self.name!r} needs AdvantageInputs.{', .'.join(missing)}")
        return self.compute(inputs)


def _entries() -> list[AdvantageEstimator]:
    E = AdvantageEstimator
    return [
        E("gae", lambda x: gae_advantages(x.token_level_rewards, x.values, x.response_mask, x.gamma, x.lam,
                                          all_reduce=x.all_reduce),
          "GAE(gamma, lam) with a critic, whitened over the batch (PPO)", needs=("values",)),
        E("grpo", lambda x: grpo_advantages(x.token_level_rewards, x.response_mask, x.index,
                                            norm_by_std=x.norm_adv_by_std_in_grpo, eps=x.epsilon),
          "(score - group mean) / (group std + eps); Dr.GRPO without the std (norm_adv_by_std_in_grpo=false)"),
        E("grpo_vectorized", lambda x: grp.grpo_vectorized_advantages(
            x.token_level_rewards, x.response_mask, x.index, norm_by_std=x.norm_adv_by_std_in_grpo, eps=x.epsilon),
          "verl's vectorized GRPO: float32 group statistics, group variance floored at eps"),
        E("grpo_passk", lambda x: grp.grpo_passk_advantages(
            x.token_level_rewards, x.response_mask, x.index, norm_by_std=x.norm_adv_by_std_in_grpo, eps=x.epsilon),
          "pass@k GRPO: only each group's best response, (best - second best) / (std + eps)"),
        E("reinforce_plus_plus", lambda x: reinforce_plus_plus_advantages(
            x.token_level_rewards, x.response_mask, x.gamma, all_reduce=x.all_reduce),
          "REINFORCE++: discounted returns (algorithm.gamma), whitened over the batch", needs=()),
        E("reinforce_plus_plus_baseline", lambda x: grp.reinforce_plus_plus_baseline_advantages(
            x.token_level_rewards, x.response_mask, x.index, all_reduce=x.all_reduce),
          "REINFORCE++ with the group mean as baseline, whitened over the batch"),
        E("remax", lambda x: remax_advantages(x.token_level_rewards, x.response_mask, x.reward_baselines),
          "ReMax: reward-to-go minus the reward of a greedy response to the same prompt",
          needs=("reward_baselines",)),
        E("rloo", lambda x: grp.rloo_advantages(x.token_level_rewards, x.response_mask, x.index),
          "RLOO: score minus the mean of the other responses to the same prompt"),
        E("rloo_vectorized", lambda x: grp.rloo_vectorized_advantages(x.token_level_rewards, x.response_mask,
                                                                      x.index),
          "verl's vectorized RLOO: as rloo, but 0 for a group of one"),
        E("opo", lambda x: grp.opo_advantages(x.token_level_rewards, x.response_mask, x.index),
          "OPO: score minus the length-weighted group mean"),
        E("gpg", lambda x: grp.gpg_advantages(x.token_level_rewards, x.response_mask, x.index,
                                              all_reduce=x.all_reduce),
          "GPG: (score - group mean) * batch size / number of non-zero scores"),
        E("gdpo", lambda x: grp.gdpo_advantages(x.reward_components, x.response_mask, x.index, x.reward_weights,
                                                norm_by_std=x.norm_adv_by_std_in_grpo, eps=x.epsilon,
                                                all_reduce=x.all_reduce),
          "GDPO: GRPO on each reward component, weighted sum whitened over the batch",
          needs=("index", "reward_components")),
        E("optimal_token_baseline", lambda x: otb.optimal_token_baseline_advantages(
            x.token_level_rewards, x.response_mask, x.index, x.old_log_probs, x.sum_pi_squared,
            x.rollout_is_weights),
          "OTB: reward-to-go minus a per-step group baseline weighted by accumulated path variance",
          needs=("index", "old_log_probs", "sum_pi_squared")),
        E("tir_optimal_token_baseline", lambda x: otb.tir_optimal_token_baseline_advantages(
            x.token_level_rewards, x.response_mask, x.index, x.old_log_probs, x.sum_pi_squared,
            x.rollout_is_weights),
          "OTB for multi-turn tool use: the per-step baseline indexed by each row's valid tokens",
          needs=("index", "old_log_probs", "sum_pi_squared")),
    ]


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {entry.name: entry for entry in _entries()}

# The estimators whose advantage for a row reads only the rows of its own group (no batch-wide whitening or
# count, no critic, no extra rollout): a streaming trainer can compute them as each group arrives.
GROUP_LOCAL_ESTIMATORS = frozenset({"grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo"})


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The entry named ``name``; a ValueError listing every name otherwise."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of: "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}") from None


def describe_advantage_estimators() -> list[tuple[str, str]]:
    """(name, one-line description) per entry, in registry order (for `scalerl config --keys`)."""
    return [(name, entry.description) for name, entry in ADVANTAGE_ESTIMATORS.items()]


def estimator_needs(name: str) -> tuple[str, ...]:
    """The `AdvantageInputs` fields beyond rewards and mask that ``name`` reads (e.g. ("values",) for gae)."""
    return get_advantage_estimator(name).needs
