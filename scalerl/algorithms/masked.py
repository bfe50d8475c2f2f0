"""Reductions over the valid (mask == 1) positions of a [B, T] tensor.

Padding positions may hold garbage (even NaN from a padded forward pass); every function here
selects with `torch.where` before reducing, so padding never leaks into a result.
"""

from __future__ import annotations

import torch

# Added to denominators that count mask entries, as verl does, so an all-padding row gives 0, not NaN.
COUNT_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of the valid entries: `sum_i m_i * x_i` (over `dim`, or over everything when None)."""
    mask = mask.to(values.dtype)
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of the valid entries: `sum_i m_i x_i / (sum_i m_i + 1e-8)`."""
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + COUNT_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid entries: `mean_m((x - mean_m(x))^2) * n / (n - 1)` with `n = sum(m)`.

    The Bessel factor `n / (n - 1)` is applied when `unbiased`; it needs at least two valid entries.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(values.dtype).sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no entry")
        if n == 1:
            raise ValueError("masked_var: the mask selects one entry; the unbiased variance is undefined")
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardize over the valid entries: `(x - mean_m(x)) / sqrt(var_m(x) + 1e-8)`.

    `var_m` is the unbiased `masked_var`. With `shift_mean=False` the mean is added back, so only
    the scale changes. Padding positions are transformed too; callers multiply by the mask if needed.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def sharded_masked_whiten(values: torch.Tensor, mask: torch.Tensor, all_reduce) -> torch.Tensor:
    """`masked_whiten` over a batch split across data-parallel ranks: the mean and unbiased variance come
    from sums ``all_reduce``d over the ranks, so every shard is whitened with the global batch's statistics
    (whitening each shard by its own would change the result with the number of ranks)."""
    m = mask.to(values.dtype)
    totals = all_reduce(torch.stack([(values * m).sum(), m.sum()]))
    mean = totals[0] / totals[1]
    n = totals[1]
    if n < 2:
        raise ValueError("sharded_masked_whiten: the masks select fewer than two entries in total")
    squared = all_reduce(((values - mean) ** 2 * m).sum().reshape(1))[0]
    var = squared / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)
