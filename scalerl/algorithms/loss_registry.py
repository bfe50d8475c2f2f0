"""`POLICY_LOSSES`: verl's policy losses by verl's names, all called the same way.

    loss_fn = get_policy_loss(cfg.actor.policy_loss)
    loss, metrics = loss_fn(old_log_prob, log_prob, advantages, response_mask, cfg.actor.loss_agg_mode,
                            options, global_num_tokens=..., global_num_seqs=..., dp_size=..., horizon=...,
                            token_weights=is_weights)

``options`` is one `PolicyLossOptions` (verl's option names and defaults; each loss reads its own). The
keyword counts are `aggregate_loss`'s global normalisation (see `losses`). ``metrics`` are detached scalars
under verl's names without ``actor/``; which names depends on the loss, as in verl (``metric_names``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from scalerl.algorithms.bypass_mode import RolloutCorrectionOptions, bypass_mode_loss
from scalerl.algorithms.covariance_losses import clip_cov_loss, kl_cov_loss
from scalerl.algorithms.losses import policy_loss
from scalerl.algorithms.policy_losses import (
    cispo_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    gspo_loss,
    sapo_loss,
)

LossAndMetrics = tuple[torch.Tensor, dict[str, torch.Tensor]]
CLIP_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


@dataclass(frozen=True)
class PolicyLossOptions:
    """verl's actor options for the policy losses (`actor.*` and `actor.policy_loss.*`), with verl's defaults.

    ``clip_ratio_low`` / ``clip_ratio_high`` fall back to ``clip_ratio`` (for dppo_* they are divergence
    thresholds). ``clip_ratio_c`` None means the loss's own verl default: 3.0 (vanilla's dual clip) or 20.0
    (dppo_*'s truncation of the importance ratio). ``dro_beta`` (verl's policy_loss.dro_beta) has no default:
    dro refuses to run without it. ``rollout_correction`` is verl's policy_loss.rollout_correction (bypass_mode).

    ``honour_loss_agg_mode``: verl 0.9.1 ignores loss_agg_mode for sapo (always seq-mean-token-mean) and
    geo_mean (a plain mean over the rows of each call); True lets loss_agg_mode decide for both instead, as
    scalerl did before it followed 0.9.1 (with global counts, so micro-batches add up for geo_mean too).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    rollout_correction: RolloutCorrectionOptions = field(default_factory=RolloutCorrectionOptions)
    honour_loss_agg_mode: bool = False

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def dual_clip(self, default: float) -> float:
        return default if self.clip_ratio_c is None else self.clip_ratio_c


# (old, logp, adv, mask, agg, options, token_weights, generator, counts) -> (loss, metrics)
LossBody = Callable[..., LossAndMetrics]


@dataclass(frozen=True)
class PolicyLoss:
    """One registry entry. ``default_agg_mode`` is the mode used when the call gives none (gspo, and sapo /
    geo_mean under ``honour_loss_agg_mode``: seq-mean-token-mean); ``options_read`` names the
    `PolicyLossOptions` fields it reads."""

    name: str
    body: LossBody
    description: str
    options_read: tuple[str, ...]
    metric_names: tuple[str, ...] = CLIP_METRICS
    default_agg_mode: str = "token-mean"

    def __call__(self, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, loss_agg_mode: str | None = None,
                 options: PolicyLossOptions | None = None, *,
                 global_num_tokens: int | torch.Tensor | None = None,
                 global_num_seqs: int | torch.Tensor | None = None, dp_size: int = 1, horizon: int | None = None,
                 token_weights: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> LossAndMetrics:
        counts = {"global_num_tokens": global_num_tokens, "global_num_seqs": global_num_seqs, "dp_size": dp_size,
                      "horizon": horizon}
        return self.body(old_log_prob, log_prob, advantages, response_mask,
                         loss_agg_mode or self.default_agg_mode, options or PolicyLossOptions(), token_weights,
                         generator, counts)


def _vanilla(old, logp, adv, mask, agg, o, weights, _generator, counts):
    return policy_loss(old, logp, adv, mask, clip_low=o.low, clip_high=o.high, clip_c=o.dual_clip(3.0), agg=agg,
                       token_weights=weights, **counts)


SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"


def _sapo(old, logp, adv, mask, agg, o, weights, _generator, counts):
    agg = agg if o.honour_loss_agg_mode else SEQ_MEAN_TOKEN_MEAN  # verl 0.9.1 pins it
    return sapo_loss(old, logp, adv, mask, o.tau_pos, o.tau_neg, agg, weights, **counts)


def _geo_mean(old, logp, adv, mask, agg, o, weights, _generator, counts):
    # verl 0.9.1: a plain mean over this call's rows (agg None), whatever loss_agg_mode says
    return geo_mean_loss(old, logp, adv, mask, o.low, o.high, agg if o.honour_loss_agg_mode else None, weights,
                         **counts)


def _bypass_mode(old, logp, adv, mask, agg, o, _weights, _generator, counts):
    # verl ignores the trainer's rollout_is_weights here: bypass computes its own from logp and old (= rollout)
    return bypass_mode_loss(old, logp, adv, mask, o.rollout_correction, o.low, o.high, o.dual_clip(3.0), agg,
                            **counts)


def _entries() -> list[PolicyLoss]:
    P, clip = PolicyLoss, ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
    seq = SEQ_MEAN_TOKEN_MEAN
    return [
        P("vanilla", _vanilla, "dual-clip PPO: max(-A r, -A clip(r)), bounded by -A clip_ratio_c for A < 0",
          clip + ("clip_ratio_c",)),
        P("gspo", lambda old, lp, a, m, agg, o, w, g, c: gspo_loss(old, lp, a, m, o.low, o.high, agg, w, **c),
          "GSPO: PPO-clip on the sequence's geometric-mean ratio", clip, default_agg_mode=seq),
        P("sapo", _sapo, "SAPO: sigmoid gate sigmoid(tau (r - 1)) 4 / tau instead of the clip",
          ("tau_pos", "tau_neg", "honour_loss_agg_mode"), default_agg_mode=seq),
        P("cispo", lambda old, lp, a, m, agg, o, w, g, c: cispo_loss(old, lp, a, m, o.low, o.high, agg, w, **c),
          "CISPO: -sg[clip(r)] A logp, the clipped ratio as a stop-gradient weight", clip),
        P("gpg", lambda old, lp, a, m, agg, o, w, g, c: gpg_loss(old, lp, a, m, agg, w, **c),
          "GPG: plain policy gradient -A logp", (), metric_names=()),
        P("geo_mean", _geo_mean, "GMPO: geometric mean of token ratios, clipped per token in log space",
          clip + ("honour_loss_agg_mode",), default_agg_mode=seq),
        P("clip_cov", lambda old, lp, a, m, agg, o, w, g, c: clip_cov_loss(
            old, lp, a, m, o.low, o.high, o.clip_cov_ratio, o.clip_cov_lb, o.clip_cov_ub, agg, w, g, **c),
          "Clip-Cov: PPO-clip with the gradient of random high-covariance tokens cut",
          clip + ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), metric_names=("pg_clipfrac", "ppo_kl")),
        P("kl_cov", lambda old, lp, a, m, agg, o, w, g, c: kl_cov_loss(
            old, lp, a, m, o.kl_cov_ratio, o.ppo_kl_coef, agg, w, **c),
          "KL-Cov: -A r plus ppo_kl_coef |log r| on the top kl_cov_ratio covariance tokens",
          ("kl_cov_ratio", "ppo_kl_coef"), metric_names=("ppo_kl",)),
        P("dppo_tv", lambda old, lp, a, m, agg, o, w, g, c: dppo_tv_loss(
            old, lp, a, m, o.low, o.high, o.dual_clip(20.0), agg, w, **c),
          "DPPO-Binary-TV: truncated-IS gradient inside a |p - p_old| trust region", clip + ("clip_ratio_c",)),
        P("dppo_kl", lambda old, lp, a, m, agg, o, w, g, c: dppo_kl_loss(
            old, lp, a, m, o.low, o.high, o.dual_clip(20.0), agg, w, **c),
          "DPPO-Binary-KL: truncated-IS gradient inside a Bernoulli-KL trust region", clip + ("clip_ratio_c",)),
        P("dro", lambda old, lp, a, m, agg, o, w, g, c: dro_loss(old, lp, a, m, o.dro_beta, agg, w, **c),
          "DRO: -(A logp - dro_beta / 2 (log r)^2), a quadratic log-ratio penalty", ("dro_beta",),
          metric_names=("ppo_kl",)),
        P("bypass_mode", _bypass_mode,
          "rollout log-probs as the old policy: PPO-clip or IS-weighted REINFORCE, with rejection sampling",
          clip + ("clip_ratio_c", "rollout_correction")),
    ]


POLICY_LOSSES: dict[str, PolicyLoss] = {entry.name: entry for entry in _entries()}

# Other spellings verl's documentation uses for the same losses.
POLICY_LOSS_ALIASES: dict[str, str] = {"clip-cov": "clip_cov", "kl-cov": "kl_cov"}


def get_policy_loss(name: str) -> PolicyLoss:
    """The entry named ``name`` (or an alias of it); a ValueError listing every name otherwise."""
    canonical = POLICY_LOSS_ALIASES.get(name, name)
    try:
        return POLICY_LOSSES[canonical]
    except KeyError:
        names = list(POLICY_LOSSES) + list(POLICY_LOSS_ALIASES)
        raise ValueError(f"unknown policy loss {name!r}; choose one of: {', '.join(names)}") from None


def describe_policy_losses() -> list[tuple[str, str]]:
    """(name, one-line description) per entry and alias, in registry order (for `scalerl config --keys`)."""
    rows = [(name, entry.description) for name, entry in POLICY_LOSSES.items()]
    return rows + [(alias, f"alias of {target}") for alias, target in POLICY_LOSS_ALIASES.items()]
