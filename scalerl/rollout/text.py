"""Text in, text out: `scalerl generate` on a model directory (or the built-in tiny model)."""

from __future__ import annotations

import torch

from scalerl.core.config import ModelSection
from scalerl.data.prompts import encode_prompts
from scalerl.models.decoder import build_model
from scalerl.models.load import builtin_model_config, load_model_and_tokenizer
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams


def generate_text(
    model_path: str,
    prompts: list[str],
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
) -> list[str]:
    """Completions of ``prompts``. ``model_path="builtin"`` uses a randomly initialised built-in model (a
    smoke test of the stack); a directory (e.g. ``outputs/demo/grpo/final``) is loaded with its tokenizer."""
    if model_path == "builtin":
        tokenizer = CharTokenizer()
        model = build_model(builtin_model_config(ModelSection(), tokenizer), seed=seed or 0)
    else:
        # Either decoder, as training would choose it (model.implementation=auto).
        model, tokenizer = load_model_and_tokenizer(ModelSection(path=model_path), None, torch.device("cpu"), seed or 0)
    model.eval()
    ids = encode_prompts(tokenizer, prompts)
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_token_ids=tokenizer.stop_token_ids, seed=seed,
    )
    out = BuiltinEngine(model, tokenizer.pad_token_id).generate(ids, sampling)
    return tokenizer.batch_decode(out.response_ids.tolist())
