"""The `actor` section (the policy's optimizer and loss, the reference model's KL loss) and `critic` (the
value model, for estimators that train one); the optimizer checks the `sft` section shares."""

from __future__ import annotations

from dataclasses import dataclass

from scalerl.core.algorithm_names import POLICY_LOSS_NAMES, choices_help, not_trainable_reason, policy_loss_choices
from scalerl.core.config.tree import Section, _check, _check_choice, opt

LR_SCHEDULES = ("constant", "cosine")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
POLICY_LOSSES = tuple(policy_loss_choices())


def check_optimizer(p: list[str], prefix: str, warmup_steps: int, lr_schedule: str) -> None:
    """Checks shared by the actor and SFT optimizer settings (their floats carry bounds of their own)."""
    _check(p, warmup_steps >= 0, f"{prefix}.warmup_steps", ">= 0", warmup_steps)
    _check_choice(p, f"{prefix}.lr_schedule", lr_schedule, LR_SCHEDULES)


@dataclass
class ActorSection(Section):
    name = "actor"
    lr: float = opt(1e-4, "peak learning rate", above=0)
    weight_decay: float = opt(0.0, "AdamW weight decay", at_least=0)
    betas: list[float] = opt(help="AdamW betas [beta1, beta2]", factory=lambda: [0.9, 0.999], at_least=0, below=1)
    warmup_steps: int = opt(0, "linear warmup steps (optimizer steps)")
    lr_schedule: str = opt("constant", "after warmup: " + " | ".join(LR_SCHEDULES))
    min_lr_ratio: float = opt(0.0, "cosine schedule floor as a fraction of lr", at_least=0, at_most=1)
    grad_clip: float = opt(1.0, "max gradient norm; 0 = off", at_least=0)
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    ppo_mini_batch_size: int = opt(64, "sequences per optimizer step")
    ppo_micro_batch_size: int = opt(16, "sequences per forward/backward (gradient accumulation)")
    shuffle: bool = opt(True, "each epoch's mini-batches take the batch's rows in a shuffled order (false: in "
                              "row order, verl's FSDP actor; with rollout.stream_groups the first mini-batches "
                              "can then start while later groups still generate)")
    micro_batch_max_tokens: int = opt(
        0, "dynamic batch size: pack micro-batches up to this many tokens (padded ones; real ones with "
        "use_remove_padding); 0 = fixed ppo_micro_batch_size"
    )
    use_remove_padding: bool = opt(False, "verl's name: update, log-prob and critic passes run on packed rows of "
                                   "real tokens (no padding; attention per sequence; built-in decoder only)")
    clip_ratio_low: float = opt(0.2, "PPO clip: ratio >= 1 - clip_ratio_low", at_least=0)
    clip_ratio_high: float = opt(0.2, "PPO clip: ratio <= 1 + clip_ratio_high", at_least=0)
    # dual clip bounds the loss of negative-advantage tokens from below; <= 1 would cut into the PPO clip
    clip_ratio_c: float = opt(3.0, "dual-clip bound for negative advantages (> 1)", above=1)
    loss_agg_mode: str = opt("token-mean", "loss aggregation: " + " | ".join(LOSS_AGG_MODES))
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient (a bonus: negative would push entropy down)",
                               at_least=0)
    use_kl_loss: bool = opt(False, "add a KL penalty to a frozen reference model to the loss")
    kl_loss_coef: float = opt(0.001, "KL penalty coefficient", at_least=0)
    kl_loss_type: str = opt("low_var_kl", " | ".join(KL_LOSS_TYPES) + "; a trailing '+' uses the straight-through form")
    policy_loss: str = opt("vanilla", "policy loss by verl's name (docs/algorithms-formulas.md); verl's recipes pair "
                           "gspo with actor.loss_agg_mode=seq-mean-token-mean (sapo and geo_mean aggregate their "
                           "own way since verl 0.9.1, whatever the mode):"
                           + choices_help(POLICY_LOSS_NAMES))
    # verl's option names for the other losses (read by the loss named in its description)
    tau_pos: float = opt(1.0, "sapo: sigmoid temperature for positive advantages", above=0)
    tau_neg: float = opt(1.05, "sapo: sigmoid temperature for negative advantages", above=0)
    clip_cov_ratio: float = opt(0.0002, "clip_cov: share of tokens whose gradient is cut", above=0, at_most=1)
    clip_cov_lb: float = opt(1.0, "clip_cov: lower bound of the covariance of the tokens it may cut", at_least=0)
    clip_cov_ub: float = opt(5.0, "clip_cov: upper bound of the covariance of the tokens it may cut", above=0)
    kl_cov_ratio: float = opt(0.0002, "kl_cov: share of tokens (highest covariance) given the |log r| penalty",
                              above=0, at_most=1)
    ppo_kl_coef: float = opt(0.1, "kl_cov: coefficient of the |log r| penalty", at_least=0)
    mask_truncated_completions: bool = opt(False, "TRL's: responses cut off at rollout.max_new_tokens count in no "
                                           "loss and no token count (their share: response_length/clip_ratio)")
    router_replay: bool = opt(False, "MoE models: rollout routing replay (R3). The built-in engine records the "
                              "experts each token was routed to, and the old/reference log-prob passes and the "
                              "update route by them (gate weights recomputed from the current router at those "
                              "experts), so router drift between engine and trainer cannot move a token to other "
                              "experts. Built-in engine, colocated, fixed batch (rollout.max_num_seqs=0), no "
                              "packing, no tp/pp/sp/ep; refused on a dense model")

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.router_replay and self.use_remove_padding:
            p.append("actor.router_replay=true with actor.use_remove_padding=true: recorded routes are laid out like "
                     "padded rows, not packed ones; set actor.use_remove_padding=false or actor.router_replay=false")
        check_optimizer(p, "actor", self.warmup_steps, self.lr_schedule)
        _check(p, len(self.betas) == 2, "actor.betas", "two values in [0, 1)", self.betas)
        _check(p, self.ppo_epochs >= 1, "actor.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(p, self.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", ">= 1", self.ppo_mini_batch_size)
        _check(p, self.ppo_micro_batch_size >= 1, "actor.ppo_micro_batch_size", ">= 1", self.ppo_micro_batch_size)
        _check_choice(p, "actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_choice(p, "actor.policy_loss", self.policy_loss, POLICY_LOSSES)
        if (why := not_trainable_reason("actor.policy_loss", self.policy_loss)) is not None:
            p.append(why)
        if self.clip_cov_lb >= self.clip_cov_ub:
            p.append(f"actor.clip_cov_lb ({self.clip_cov_lb}) must be below actor.clip_cov_ub ({self.clip_cov_ub})")
        if self.kl_loss_type.removesuffix("+") not in KL_LOSS_TYPES:
            p.append(f"actor.kl_loss_type must be one of {', '.join(KL_LOSS_TYPES)} (optionally with a "
                     f"trailing '+'); got {self.kl_loss_type!r}")
        if not p and self.ppo_mini_batch_size % self.ppo_micro_batch_size:
            p.append(f"actor.ppo_micro_batch_size ({self.ppo_micro_batch_size}) must divide "
                     f"actor.ppo_mini_batch_size ({self.ppo_mini_batch_size})")
        return p


@dataclass
class CriticSection(Section):
    """Value model settings; used when algorithm.adv_estimator needs a critic (gae)."""

    name = "critic"
    lr: float = opt(1e-4, "critic learning rate", above=0)
    cliprange_value: float = opt(0.5, "value clipping range around the old values", at_least=0)
    value_loss_coef: float = opt(0.5, "value loss weight", at_least=0)
