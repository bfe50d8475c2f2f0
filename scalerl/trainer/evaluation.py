"""Held-out accuracy: greedy (or low-temperature) completions of the evaluation rows, scored by the reward."""

from __future__ import annotations

from typing import Any

import torch

from scalerl.data.prompts import encode_prompts
from scalerl.data.rewards import RewardComputer
from scalerl.rollout.engine import RolloutEngine, SamplingParams


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    rows: list[dict],
    reward: RewardComputer,
    max_new_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 256,
    seed: int = 0,
    chat_template: bool = False,
) -> dict[str, float]:
    """``val/accuracy`` (share of rows whose reward is >= 1, i.e. exactly right) and ``val/score/mean``."""
    scores: list[float] = []
    lengths: list[float] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=tokenizer.stop_token_ids, seed=seed
        )
        out = engine.generate(encode_prompts(tokenizer, [r["prompt"] for r in chunk], chat_template), sampling)
        texts = tokenizer.batch_decode(out.response_ids.tolist())
        chunk_scores, _ = reward.compute(texts, chunk)
        scores.extend(chunk_scores)
        lengths.extend(out.response_lengths.tolist())
    t = torch.tensor(scores)
    return {
        "val/accuracy": float((t >= 1.0).float().mean()),
        "val/score/mean": float(t.mean()),
        "val/response_length/mean": float(torch.tensor(lengths, dtype=torch.float).mean()),
    }
