"""Per-token quantities from logits [..., V]: entropy and the log-prob of a label.

Both work on chunks of tokens so that only a [chunk, V] float32 temporary exists at a time; with a
150k vocabulary a full float32 softmax of 16k tokens would be ~10 GB. Each token is reduced over
the vocabulary on its own, so the result does not depend on the chunk size. Under autograd each
chunk's intermediates are kept for backward, so the saving is full only under `torch.no_grad()`
(old/ref log-probs, metrics); with gradients it bounds the forward peak.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_TOKENS = 2048


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logsumexp loses digits; float64 callers keep their precision.
    return torch.promote_types(dtype, torch.float32)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Entropy of softmax(z) per token: `H = logsumexp(z) - sum_v softmax(z)_v * z_v`.

    `logits` is [..., V]; the result is [...] in float32 (float64 for float64 input). Differentiable.
    The logsumexp form is stable for any logit scale (no log of a vanishing probability).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    dtype = _compute_dtype(logits.dtype)
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(dtype)
        probs = torch.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=dtype)
    return out.reshape(logits.shape[:-1])


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """Log-probability of each label: `log softmax(z)_y = z_y - logsumexp(z)`.

    `logits` is [..., V], `labels` is [...] (int); the result is [...] in float32 (float64 for
    float64 input). Differentiable. Never materializes the full [..., V] log-softmax.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1, 1).to(torch.long)
    dtype = _compute_dtype(logits.dtype)
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(dtype)
        label_logit = chunk.gather(-1, flat_labels[start : start + chunk_size]).squeeze(-1)
        pieces.append(label_logit - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=dtype)
    return out.reshape(labels.shape)
