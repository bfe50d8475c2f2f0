"""verl 0.9.1's `bypass_mode` policy loss: the rollout engine's log-probs serve as the old policy's (no
recomputation), and the loss corrects for the engine/trainer mismatch itself, from the current policy's
log-probs against the rollout's:

    log r = logp - rollout_logp       (rollout_logp is the ``old_logp`` the loss is given)
    1. importance weights (``rollout_is`` = "token" | "sequence" | None), detached:
         token: exp(clamp(log r, -20, 20)) m;  sequence: exp(clamp(sum_t m log r, -20, 20)) on every token
         threshold "U" (TIS): min(w, U);  "L_U" (IcePop): w where L <= w <= U, else 0
         ``rollout_is_batch_normalize``: w / mean(w) (token: over valid tokens; sequence: over non-empty rows)
    2. rejection (``rollout_rs``, comma-separated options, all must pass): the tokens or whole rows whose
       divergence estimate is out of bounds leave the mask. With lr = clamp(log r, -20, 20):
         k1 = -lr,  k2 = lr^2 / 2,  k3 = exp(lr) - 1 - lr
         token_k{1,2,3}: per token;  seq_sum_k*, seq_mean_k*: sum / mean over the row;  seq_max_k{2,3}: max
         k1 options keep log(L) <= k1 <= log(U) (a single "U" means L = 1/U); the others keep k <= U
    3. the loss on the remaining mask: ``loss_type`` "ppo_clip" = dual-clip PPO against rollout_logp without
       the weights (the clipped ratio is the correction); "reinforce" = -A logp w (no clip).
Metrics: ppo_clip the dual clip's (pg_clipfrac, ppo_kl, pg_clipfrac_lower), reinforce ppo_kl only, both over
the remaining mask. verl also logs its rollout_corr/* diagnostics here; scalerl logs the mismatch where the
trainer measures it (`importance`), not from the loss.

Differences from verl: the trainer's ``token_weights`` are ignored as in verl (bypass computes its own); an
all-padding micro-batch gives a zero loss where verl raises; batch normalisation is over this call's tokens,
so it is refused with dp_size > 1 (verl all-reduces that mean over the ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scalerl.algorithms.losses import LOG_RATIO_CLAMP, aggregate_loss, policy_loss
from scalerl.algorithms.masked import masked_mean, masked_sum

IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                     "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class RolloutCorrectionOptions:
    """verl's actor.policy_loss.rollout_correction keys that `bypass_mode` reads, with verl's defaults."""

    loss_type: str = "ppo_clip"
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """(upper, lower or None) from "U" / U (TIS) or "L_U" (IcePop); positive, lower <= upper."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    text = str(spec).strip()
    try:
        if isinstance(spec, str) and "_" in text:
            lower_text, upper_text = text.split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            upper = float(text)
    except ValueError as exc:
        raise ValueError(f"invalid rollout_is_threshold {spec!r}") from exc
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def parse_rejection_thresholds(options: list[str], spec: float | str | None) -> dict[str, tuple[float | None, float]]:
    """Per option (lower or None, upper): one threshold shared by all, or one per option (comma-separated)."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be given when rollout_rs is set")
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs one threshold or {len(options)} (one per rollout_rs option)")
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = {}
    for option, text in zip(options, specs):
        try:
            if option.endswith("k1"):
                lower_text, upper_text = text.split("_", 1) if "_" in text else (str(1.0 / float(text)), text)
                lower, upper = float(lower_text), float(upper_text)
                if lower <= 0 or upper <= 0 or lower > upper:
                    raise ValueError(f"thresholds for {option} must be positive with lower <= upper, got {text!r}")
            else:
                if "_" in text:
                    raise ValueError(f"{option} takes a single upper bound, got {text!r}")
                lower, upper = None, float(text)
                if upper <= 0:
                    raise ValueError(f"the threshold for {option} must be positive, got {text!r}")
        except ValueError as exc:
            raise ValueError(f"invalid rollout_rs_threshold for {option}: {exc}") from exc
        bounds[option] = (lower, upper)
    return bounds


@torch.no_grad()
def bypass_importance_weights(log_ratio, mask, level: str, threshold: float | str,
                              batch_normalize: bool = False) -> torch.Tensor:
    """Step 1 of the module docstring: [B, T] weights, zero on padding."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is {level!r}; choose one of {IS_LEVELS} or None")
    upper, lower = parse_is_threshold(threshold)
    mask = mask.to(log_ratio.dtype)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
        raw = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            rows = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, mask, dim=-1) * rows).sum() / rows.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
    return weights


@torch.no_grad()
def rollout_rejection_mask(log_ratio, mask, options: str, threshold: float | str | None) -> torch.Tensor:
    """Step 2 of the module docstring: ``mask`` with the rejected tokens and rows set to 0 (same dtype)."""
    names = list(dict.fromkeys(name.strip() for name in options.split(",") if name.strip()))
    if not names:
        raise ValueError("rollout_rs names no option")
    unknown = [name for name in names if name not in REJECTION_OPTIONS]
    if unknown:
        raise ValueError(f"unknown rollout_rs option(s) {unknown}; choose from {REJECTION_OPTIONS}")
    bounds = parse_rejection_thresholds(names, threshold)
    safe = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    divergences = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    valid = mask.bool()
    keep = torch.ones_like(valid)
    for name in names:
        lower, upper = bounds[name]
        estimate = divergences[name[-2:]]
        if name.startswith("seq_sum"):
            estimate = masked_sum(estimate, mask, dim=-1).unsqueeze(-1)
        elif name.startswith("seq_mean"):
            estimate = masked_mean(estimate, mask, dim=-1).unsqueeze(-1)
        elif name.startswith("seq_max"):
            estimate = estimate.masked_fill(~valid, float("-inf")).max(dim=-1, keepdim=True).values
            estimate = torch.where(estimate == float("-inf"), torch.zeros_like(estimate), estimate)
        if lower is not None:  # k1 bounds are ratios compared in log space, as verl does
            kept = (estimate >= math.log(lower)) & (estimate <= math.log(upper))
        else:
            kept = estimate <= upper
        keep = keep & kept.expand_as(valid)
    return (mask * keep.to(mask.dtype)).to(mask.dtype)


def bypass_mode_loss(rollout_logp, logp, advantages, response_mask, correction: RolloutCorrectionOptions,
                     clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                     agg: str = "token-mean", **agg_counts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl 0.9.1 `bypass_mode` (module docstring); ``rollout_logp`` is the engine's log-probs."""
    if correction.loss_type not in LOSS_TYPES:
        raise ValueError(f"bypass_mode loss_type {correction.loss_type!r}; choose one of {LOSS_TYPES}")
    log_ratio = (logp - rollout_logp).detach()
    weights = None
    if correction.rollout_is is not None and correction.rollout_is_threshold is not None:
        if correction.rollout_is_batch_normalize and agg_counts.get("dp_size", 1) > 1:
            raise ValueError("bypass_mode with rollout_is_batch_normalize normalises over this rank's tokens; "
                             "it is not supported with dp_size > 1")
        weights = bypass_importance_weights(log_ratio, response_mask, correction.rollout_is,
                                            correction.rollout_is_threshold, correction.rollout_is_batch_normalize)
    mask = response_mask
    if correction.rollout_rs is not None:
        mask = rollout_rejection_mask(log_ratio, response_mask, correction.rollout_rs,
                                      correction.rollout_rs_threshold)
    if correction.loss_type == "ppo_clip":  # the clipped ratio to the rollout policy is the correction itself
        return policy_loss(rollout_logp, logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                           clip_c=clip_c, agg=agg, **agg_counts)
    token_losses = -advantages * logp if weights is None else -advantages * logp * weights
    loss = aggregate_loss(token_losses, mask, agg, **agg_counts)
    return loss, {"ppo_kl": masked_mean(-(logp - rollout_logp), mask).detach()}
