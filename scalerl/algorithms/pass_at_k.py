"""Sampled evaluation: pass@k (the unbiased estimator of Chen et al., arXiv 2107.03374), mean@n and maj@n
over n samples per prompt, averaged over the prompts of each data source."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c of them correct, is correct):
    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i) for stability."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_value(predictions: Sequence[Hashable], values: Sequence[float]) -> float:
    """maj@n for one prompt (verl `calc_maj_val`): the value of the first sample whose prediction is the most
    common one (ties between predictions: the one seen first)."""
    counts = Counter(predictions)
    top = max(counts, key=counts.__getitem__)  # max keeps the first of equal counts, in insertion order
    return float(values[list(predictions).index(top)])


def sampled_eval_metrics(data_sources: Sequence[str], prompt_ids: Sequence[Hashable], scores: Sequence[float],
                         correct: Sequence[bool], k: int, predictions: Sequence[Hashable] | None = None,
                         prefix: str = "val") -> dict[str, float]:
    """Per data source s, averaged over its prompts (each with its n >= k samples):
        {prefix}/{s}/pass@{k}  unbiased pass@k of ``correct``
        {prefix}/{s}/mean@{k}  mean score of the prompt's samples
        {prefix}/{s}/maj@{k}   score of the majority prediction (only with ``predictions``)
    """
    per_prompt: dict[tuple[str, Hashable], list[int]] = defaultdict(list)
    for i, key in enumerate(zip(data_sources, prompt_ids, strict=True)):
        per_prompt[key].append(i)
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (source, _), rows in per_prompt.items():
        if len(rows) < k:
            raise ValueError(f"pass@{k} needs at least {k} samples per prompt; a prompt of {source!r} has {len(rows)}")
        stats = per_source[source]
        stats[f"pass@{k}"].append(pass_at_k(len(rows), sum(bool(correct[i]) for i in rows), k))
        stats[f"mean@{k}"].append(float(np.mean([scores[i] for i in rows])))
        if predictions is not None:
            stats[f"maj@{k}"].append(majority_value([predictions[i] for i in rows], [scores[i] for i in rows]))
    return {f"{prefix}/{source}/{name}": float(np.mean(vals))
            for source, stats in per_source.items() for name, vals in stats.items()}
