"""RL algorithms as pure functions (verl-equivalent, free of trainer state): advantages, policy and value
losses with their aggregation, KL penalties, entropy and log-probs, masked statistics."""

from scalerl.algorithms.advantages import gae_advantages, group_index, grpo_advantages
from scalerl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.algorithms.kl import KL_KINDS, kl_estimate, kl_penalty
from scalerl.algorithms.losses import AGG_MODES, aggregate_loss, policy_loss, value_loss
from scalerl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AGG_MODES", "KL_KINDS", "aggregate_loss", "entropy_from_logits", "gae_advantages", "group_index",
    "grpo_advantages", "kl_estimate", "kl_penalty", "logprobs_from_logits", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "policy_loss", "value_loss",
]
