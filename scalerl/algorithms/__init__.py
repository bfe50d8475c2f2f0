"""RL algorithms as pure functions (verl-equivalent, free of trainer state): advantage estimators and policy
losses with registries by verl's names, their aggregation, KL penalties (loss and reward), DAPO's batch
shaping, sampled-evaluation metrics, entropy and log-probs, masked statistics."""

from scalerl.algorithms.advantages import (
    gae_advantages,
    group_index,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
)
from scalerl.algorithms.bypass_mode import RolloutCorrectionOptions
from scalerl.algorithms.dapo import (
    groups_with_signal,
    mask_truncated_completions,
    overlong_penalty,
)
from scalerl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.algorithms.estimator_registry import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    describe_advantage_estimators,
    estimator_needs,
    get_advantage_estimator,
)
from scalerl.algorithms.kl import KL_KINDS, kl_estimate, kl_penalty
from scalerl.algorithms.kl_reward import (
    KL_CONTROLLER_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)
from scalerl.algorithms.loss_registry import (
    POLICY_LOSS_ALIASES,
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossOptions,
    describe_policy_losses,
    get_policy_loss,
)
from scalerl.algorithms.losses import AGG_MODES, aggregate_loss, policy_loss, value_loss
from scalerl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from scalerl.algorithms.pass_at_k import majority_value, pass_at_k, sampled_eval_metrics

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "KL_CONTROLLER_TYPES", "KL_KINDS", "POLICY_LOSSES", "POLICY_LOSS_ALIASES",
    "AdaptiveKLController", "AdvantageEstimator", "AdvantageInputs", "FixedKLController", "PolicyLoss",
    "PolicyLossOptions", "RolloutCorrectionOptions", "aggregate_loss", "apply_kl_penalty",
    "describe_advantage_estimators", "describe_policy_losses", "entropy_from_logits", "estimator_needs",
    "gae_advantages", "get_advantage_estimator", "get_policy_loss", "group_index", "groups_with_signal",
    "grpo_advantages", "kl_estimate", "kl_penalty",
    "logprobs_from_logits", "majority_value", "make_kl_controller", "mask_truncated_completions", "masked_mean",
    "masked_sum", "masked_var", "masked_whiten", "overlong_penalty", "pass_at_k", "policy_loss",
    "reinforce_plus_plus_advantages", "remax_advantages", "sampled_eval_metrics", "value_loss",
]
