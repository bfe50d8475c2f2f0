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
    "reward_baselines" = a greedy rollout per prompt scored as the baseline, "reward_components" = each reward
    component's score per sample, "old_log_probs" / "sum_pi_squared" = the old policy's per-token log-probs
    and sum of squared token probabilities (see `scalerl.algorithms.AdvantageInputs`)."""

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
    "gdpo": EstimatorName("GDPO: GRPO on each reward component, weighted sum whitened over the batch",
                          ("index", "reward_components")),
    "optimal_token_baseline": EstimatorName("OTB: reward-to-go minus a per-step group baseline weighted by "
                                            "accumulated path variance", ("index", "old_log_probs", "sum_pi_squared")),
    "tir_optimal_token_baseline": EstimatorName("OTB for multi-turn tool use: the per-step baseline indexed by each "
                                                "row's valid tokens", ("index", "old_log_probs", "sum_pi_squared")),
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
    "dro": "DRO: -(A logp - dro_beta / 2 (log r)^2), a quadratic log-ratio penalty",
    "bypass_mode": "rollout log-probs as the old policy: PPO-clip or IS-weighted REINFORCE, with rejection sampling",
}
# Names the registries hold (callable as functions, equal to verl 0.9.1) whose inputs or settings the trainer
# does not give yet: a run naming one is refused with what is missing (`not_trainable_reason`).
NOT_YET_TRAINABLE: dict[str, str] = {
    "gdpo": "each reward component's score per sample (verl's algorithm.gdpo_reward_keys), which the reward "
            "functions do not report separately yet",
    "optimal_token_baseline": "the old policy's sum of squared token probabilities from the old-log-prob pass "
                              "(verl's actor.calculate_sum_pi_squared)",
    "tir_optimal_token_baseline": "the old policy's sum of squared token probabilities from the old-log-prob pass "
                                  "(verl's actor.calculate_sum_pi_squared)",
    "dro": "its dro_beta, which has no config key yet",
    "bypass_mode": "its rollout-correction settings, which have no config keys yet (with verl's defaults it is "
                   "the vanilla loss)",
}


def not_trainable_reason(key: str, name: str) -> str | None:
    """Why a run cannot use ``name`` for config ``key`` yet (None: it can)."""
    missing = NOT_YET_TRAINABLE.get(name)
    if missing is None:
        return None
    return (f"{key}={name} is in scalerl.algorithms (as verl 0.9.1 computes it) but the trainer does not give it "
            f"{missing}; choose another for now")


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
