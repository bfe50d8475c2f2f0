"""Reference checkpoints from transformers' own classes, and the token batches parity tests compare on."""

from __future__ import annotations

import torch


def randomize_norms_and_biases(model: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """Perturb what transformers initialises to constants (biases 0, norm weights 0 or 1), so a parity check
    exercises them too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * scale)
    return model


def token_batch(vocab: int, padded: bool, batch: int = 3, length: int = 12, seed: int = 1):
    """``(ids, mask)``; padded: left padding of different lengths (rows 0 and 2), as in batched prompts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
        mask[2, :7] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def hf_logits(hf_model, ids: torch.Tensor, mask: torch.Tensor, padded: bool) -> torch.Tensor:
    """transformers' logits, positions counted over real tokens (as scalerl does) when padded."""
    with torch.no_grad():
        if padded:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            return hf_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        return hf_model(input_ids=ids).logits


def max_diff_on_real_tokens(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    valid = mask.bool()
    return (got[valid] - ref[valid]).abs().max().item()
