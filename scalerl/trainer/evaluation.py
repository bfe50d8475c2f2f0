"""Held-out accuracy: greedy (or low-temperature) completions of the evaluation rows, scored by the reward;
and sampled evaluation: n completions per row, pass@n / mean@n / maj@n overall and per data source.

A completion is one answer of the engine, or, in a multi-turn run, a whole episode (`answers`: the source's
``episodes``, the same environment, tools and limits the run trains with), scored as training scores it: the
environment's own reward where it gives one, the run's reward on the trajectory's text elsewhere. So an agent
run is evaluated as it is trained, never on a single turn behind its back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from scalerl.algorithms.pass_at_k import sampled_eval_metrics
from scalerl.data.errors import DataError
from scalerl.data.prompts import encode_prompts
from scalerl.data.rewards.computer import RewardComputer
from scalerl.data.rewards.functions import RewardFunctionError
from scalerl.rollout.engines.engine import RolloutEngine, SamplingParams


def evaluate(
    engine: RolloutEngine | Any,
    tokenizer: Any,
    rows: list[dict],
    reward: RewardComputer,
    max_new_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 256,
    seed: int = 0,
    chat_template: bool = False,
    row_offset: int = 0,
    total_rows: int | None = None,
) -> dict[str, float]:
    """``val/accuracy`` (share of rows whose reward is >= 1, i.e. exactly right) and ``val/score/mean``.
    ``rows`` may be a share of the set, starting at its row ``row_offset`` of ``total_rows``: at a temperature
    > 0 a row's sample then depends only on its place in the whole set (any DP split samples the same)."""
    scores: list[float] = []
    lengths: list[float] = []
    total_rows = len(rows) if total_rows is None else total_rows
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=tokenizer.stop_token_ids, seed=seed,
            row_offset=row_offset + start, total_rows=total_rows,
        )
        texts, chunk_lengths, given = answers(engine, tokenizer, chunk, sampling, chat_template)
        chunk_scores, _ = scored_validation(reward, texts, chunk, given)
        scores.extend(chunk_scores)
        lengths.extend(chunk_lengths)
    t = torch.tensor(scores)
    return {
        "val/accuracy": float((t >= 1.0).float().mean()),
        "val/score/mean": float(t.mean()),
        "val/response_length/mean": float(torch.tensor(lengths, dtype=torch.float).mean()),
    }


def answers(engine: Any, tokenizer: Any, rows: list[dict], sampling: SamplingParams,
            chat_template: bool) -> tuple[list[str], list[int], list[float | None]]:
    """Each row's answer text, its length in tokens and the environment's reward (None: none given). ``engine``
    is a `RolloutEngine` (one answer per row) or a multi-turn source with ``episodes(rows, sampling)``."""
    episodes = getattr(engine, "episodes", None)
    if episodes is not None:
        return episodes(rows, sampling)
    out = engine.generate(encode_prompts(tokenizer, [r["prompt"] for r in rows], chat_template), sampling)
    return tokenizer.batch_decode(out.response_ids.tolist()), out.response_lengths.tolist(), [None] * len(rows)


def scored_validation(reward: RewardComputer, texts: list[str], rows: list[dict],
                      given: Sequence[float | None] | None = None) -> tuple[list[float], int]:
    """`reward.compute` on validation rows (but those whose environment gave a reward: ``given``); a reward that
    cannot take them says it was these rows (the line at start says where they come from: data.val_files,
    held out from data.train_files, or the built-in task)."""
    given = list(given) if given is not None else [None] * len(rows)
    todo = [i for i, g in enumerate(given) if g is None]
    scores = [0.0 if g is None else float(g) for g in given]
    if not todo:
        return scores, 0
    try:
        computed, failures = reward.compute([texts[i] for i in todo], [rows[i] for i in todo])
    except (RewardFunctionError, DataError) as error:
        raise type(error)(f"scoring the validation rows: {error}") from None
    for i, score in zip(todo, computed):
        scores[i] = score
    return scores, failures


def data_source_of(row: dict, default: str) -> str:
    """The data source a row's sampled metrics are grouped under (``default``: the task's name)."""
    return row.get("data_source") or default


def evaluate_sampled(
    engine: RolloutEngine | Any,
    tokenizer: Any,
    rows: list[dict],
    reward: RewardComputer,
    max_new_tokens: int,
    n: int,
    temperature: float,
    sources: Sequence[str],
    default_source: str,
    *,
    seed: int = 0,
    chat_template: bool = False,
    row_offset: int = 0,
    total_rows: int | None = None,
    batch_size: int = 256,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """``val/{pass,mean,maj}@n`` over every prompt and ``val/<source>/{pass,mean,maj}@n`` per data source,
    from ``n`` samples per row at ``temperature`` (`sampled_eval_metrics`; correct = reward >= 1, like
    ``val/accuracy``; maj@n votes over the responses' stripped texts).

    ``rows`` may be this rank's share of the evaluation set, starting at its row ``row_offset`` of
    ``total_rows``: the samples depend only on a row's place in the whole set, and with ``all_reduce``
    (SUM over DP ranks) the per-prompt values are averaged over the whole set. ``sources`` (every data
    source of the whole set, the same list on every rank) fixes the keys, so each rank reports the same
    ones even where its share lacks a source.
    """
    total_rows = len(rows) if total_rows is None else total_rows
    chunk_rows = max(1, batch_size // n)
    data_sources, prompt_ids, scores, predictions = [], [], [], []
    for start in range(0, len(rows), chunk_rows):
        chunk = rows[start : start + chunk_rows]
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                  stop_token_ids=tokenizer.stop_token_ids, seed=seed,
                                  row_offset=(row_offset + start) * n, total_rows=total_rows * n)
        sample_rows = [row for row in chunk for _ in range(n)]
        texts, _, given = answers(engine, tokenizer, sample_rows, sampling, chat_template)
        chunk_scores, _ = scored_validation(reward, texts, sample_rows, given)
        scores.extend(chunk_scores)
        predictions.extend(text.strip() for text in texts)
        prompt_ids.extend(row_offset + start + i // n for i in range(len(sample_rows)))
        data_sources.extend(data_source_of(row, default_source) for row in sample_rows)
    correct = [score >= 1.0 for score in scores]
    names = (f"pass@{n}", f"mean@{n}", f"maj@{n}")
    # Per source: [sum over prompts of each metric..., prompts]; a prompt-weighted sum over ranks is exact.
    sums = torch.zeros(len(sources), len(names) + 1, dtype=torch.float64)
    if scores:
        local = sampled_eval_metrics(data_sources, prompt_ids, scores, correct, k=n, predictions=predictions)
        prompts_of = {s: len({p for p, d in zip(prompt_ids, data_sources) if d == s}) for s in set(data_sources)}
        for i, source in enumerate(sources):
            if source in prompts_of:
                count = prompts_of[source]
                sums[i] = torch.tensor([local[f"val/{source}/{name}"] * count for name in names] + [count])
    if all_reduce is not None:
        sums = all_reduce(sums)
    metrics: dict[str, float] = {}
    for i, source in enumerate(sources):
        count = float(sums[i, -1])
        metrics.update({f"val/{source}/{name}": float(sums[i, j]) / count if count else float("nan")
                        for j, name in enumerate(names)})
    total = sums.sum(0)
    metrics.update({f"val/{name}": float(total[j] / total[-1]) for j, name in enumerate(names)})
    return metrics
