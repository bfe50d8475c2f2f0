"""Token sampling from logits: temperature, top-k, top-p (nucleus), greedy; batched, no per-row Python."""

from __future__ import annotations

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k set and outside the smallest nucleus with mass >= top_p to -inf.

    The most likely token always survives, so no row is left empty.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; drop a token once that mass already reaches top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[B, V]``; returns ``(tokens [B], logprobs [B])``.

    The log-prob is that of ``softmax(logits / T)`` before truncation (T = 1 for greedy): the value a
    training forward pass at the same temperature recomputes. It is read off the probabilities the draw
    uses (``log`` of the sampled token's, ``[B]``) rather than from a ``log_softmax`` over the vocabulary:
    one full pass fewer (at a 151,936-token vocabulary and 64 rows, a pass over 39 MB), equal to it within
    fp32 rounding (tested against a full forward's log-probs).
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)
    scaled = logits if temperature == 1 else logits / temperature  # x / 1 == x: skip a [B, V] pass
    probs = scaled.softmax(dim=-1)
    filtered = filter_top_k_top_p(scaled, top_k, top_p)
    tokens = sample_from_logits(filtered, generator, uniform, probs if filtered is scaled else None)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


def sample_from_logits(
    logits: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row instead of ``torch.multinomial``'s one per vocabulary
    entry (5x faster at small batch on CPU). ``right=True`` never lands on a zero-probability token.
    ``uniform`` ``[B]`` supplies the draws (pre-generated per global row); otherwise ``generator`` does.
    ``probs``: ``logits.softmax(-1)`` when the caller has it already (read, not written)."""
    cdf = (logits.softmax(dim=-1) if probs is None else probs).cumsum(dim=-1)
    if uniform is None:
        uniform = torch.rand(cdf.shape[0], device=cdf.device, generator=generator)
    u = uniform.unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
