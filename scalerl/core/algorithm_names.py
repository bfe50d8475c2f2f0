"""The names `algorithm.adv_estimator` and `actor.policy_loss` accept (verl's), each with its one-line
description and, for an estimator, the inputs it needs beyond rewards and mask: plain data, so that the
config checks them and `scalerl config --keys` lists them without importing torch. The registries in
`scalerl.algorithms` (`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`) hold the functions; a test keeps the two
tables equal, name for name, line for line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorName:
    """``needs``: "index" = groups of samples per prompt (rollout.n >= 2), "values" = a critic,
    "reward_baselines" = a greedy rollout per prompt scored as the baseline."""

    description: str
    needs: tuple[str, ...] = ("index",)


ADVANTAGE_ESTIMATOR_NAMES: dict[str, EstimatorName] = {
    "gae": EstimatorName("GAE(gamma, lam) with a critic, whitened over the batch (PPO)", ("values",)),
    "grpo": EstimatorName("(score - group mean) / (group std + eps); Dr.GRPO without the std "
                          "(norm_adv_by_std_in_grpo=false)"),
    "grpo_vectorized": EstimatorName("verl's vectorized GRPO: float32 group statistics, group variance floored "
                                     "at eps"),
    "grpo_passk": EstimatorName("pass@k GRPO: only each group's best response, (best - second best) / (std + eps)"),
    "reinforce_plus_plus": EstimatorName("REINFORCE++: discounted returns (algorithm.gamma), whitened over the batch",
                                         ()),
    "reinforce_plus_plus_baseline": EstimatorName("REINFORCE++ with the group mean as baseline, whitened over the "
                                                  "batch"),
    "remax": EstimatorName("ReMax: reward-to-go minus the reward of a greedy response to the same prompt",
                           ("reward_baselines",)),
    "rloo": EstimatorName("RLOO: score minus the mean of the other responses to the same prompt"),
    "rloo_vectorized": EstimatorName("verl's vectorized RLOO: as rloo, but 0 for a group of one"),
    "opo": EstimatorName("OPO: score minus the length-weighted group mean"),
    "gpg": EstimatorName("GPG: (score - group mean) * batch size / number of non-zero scores"),
}

POLICY_LOSS_NAMES: dict[str, str] = {
    "vanilla": "dual-clip PPO: max(-A r, -A clip(r)), bounded by -A clip_ratio_c for A < 0",
    "gspo": "GSPO: PPO-clip on the sequence's geometric-mean ratio",
    "sapo": "SAPO: sigmoid gate sigmoid(tau (r - 1)) 4 / tau instead of the clip",
    "cispo": "CISPO: -sg[clip(r)] A logp, the clipped ratio as a stop-gradient weight",
    "gpg": "GPG: plain policy gradient -A logp",
    "geo_mean": "GMPO: geometric mean of token ratios, clipped per token in log space",
    "clip_cov": "Clip-Cov: PPO-clip with the gradient of random high-covariance tokens cut",
    "kl_cov": "KL-Cov: -A r plus ppo_kl_coef |log r| on the top kl_cov_ratio covariance tokens",
    "dppo_tv": "DPPO-Binary-TV: truncated-IS gradient inside a |p - p_old| trust region",
    "dppo_kl": "DPPO-Binary-KL: truncated-IS gradient inside a Bernoulli-KL trust region",
}
# Other spellings verl's documentation uses for the same losses.
POLICY_LOSS_ALIASES: dict[str, str] = {"clip-cov": "clip_cov", "kl-cov": "kl_cov"}


def estimator_name(name: str) -> EstimatorName:
    """The entry of ``name``; a KeyError for an unknown one (the config reports it with the choices)."""
    return ADVANTAGE_ESTIMATOR_NAMES[name]


def needs_critic(adv_estimator: str) -> bool:
    """Whether the run trains a value model for this estimator (its advantages read critic values)."""
    return "values" in estimator_name(adv_estimator).needs


def needs_groups(adv_estimator: str) -> bool:
    """Whether the estimator compares the samples of one prompt (so rollout.n >= 2 and sampling > 0)."""
    return "index" in estimator_name(adv_estimator).needs


def needs_greedy_baseline(adv_estimator: str) -> bool:
    """Whether each step also generates one greedy response per prompt, scored as its baseline (remax)."""
    return "reward_baselines" in estimator_name(adv_estimator).needs


def policy_loss_choices() -> list[str]:
    """Every accepted `actor.policy_loss` value: the names, then the aliases."""
    return [*POLICY_LOSS_NAMES, *POLICY_LOSS_ALIASES]


def choices_help(rows: dict[str, str]) -> str:
    """One indented line per name (``name  description``) for a key's help in `scalerl config --keys`."""
    width = max(len(name) for name in rows) + 2
    return "".join(f"\n      {name:{width}}{line}" for name, line in rows.items())
