"""Per-token estimators of KL(pi || pi_ref) from the sampled tokens' log-probs.

See J. Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html); kinds and
clamps follow verl's `kl_penalty` in `core_algos.py` (the version that strips the `+` suffix).
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """The k-estimator itself, with its own gradient. With d = logp - ref_logp:

        k1 / kl          d
        abs              |d|
        k2 / mse         d^2 / 2
        k3 / low_var_kl  clamp(exp(-d') + d' - 1, -10, 10),  d' = clamp(d, -20, 20)
    """
    if kind in ("k1", "kl"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("k3", "low_var_kl"):
        # exp of a large log-ratio overflows; clamp as verl does, then clamp the estimate itself.
        log_ratio = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {KL_KINDS}, optionally with a trailing '+'")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL penalty [B, T] of the given `kind` (see `kl_estimate`).

    A trailing `+` (e.g. "k3+") selects the straight-through variant: the forward value is the
    named estimator, the gradient is that of k2 (the only unbiased KL-gradient estimator here):
        out = k2 - stopgrad(k2) + stopgrad(k_kind)
    so d out / d logp = logp - ref_logp. "k2+" equals "k2".
    """
    straight_through = kind.endswith("+")
    base_kind = kind[:-1] if straight_through else kind
    forward = kl_estimate(logp, ref_logp, base_kind)
    if not straight_through or base_kind in ("k2", "mse"):
        return forward
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + forward.detach()
