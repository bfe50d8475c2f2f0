"""RL algorithms (advantages, losses, KL, entropy) and the trainers built on them.

The algorithm functions are importable from here; trainers live in `grpo_trainer` (GRPO / PPO) and
`sft_trainer` and are imported from their modules (they pull in the parallel and data packages).
"""

from scalerl.rl.advantages import gae_advantages, group_index, grpo_advantages
from scalerl.rl.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.rl.kl import KL_KINDS, kl_estimate, kl_penalty
from scalerl.rl.losses import AGG_MODES, aggregate_loss, policy_loss, value_loss
from scalerl.rl.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AGG_MODES", "KL_KINDS", "aggregate_loss", "entropy_from_logits", "gae_advantages", "group_index",
    "grpo_advantages", "kl_estimate", "kl_penalty", "logprobs_from_logits", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "policy_loss", "value_loss",
]
