"""Prompts and demonstrations as token ids."""

from __future__ import annotations

from typing import Any


def encode_prompts(tokenizer: Any, prompts: list[str], chat_template: bool = False) -> list[list[int]]:
    """Prompt token ids. Plain: the tokenizer's BOS (when it has one) + the text. With ``chat_template``,
    each prompt becomes a user message rendered by the tokenizer's chat template with the generation prompt
    appended (instruct models); the template supplies its own special tokens, so no BOS is added."""
    if chat_template:
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                    for p in prompts]
        return [tokenizer.encode(text) for text in rendered]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer.encode(p) for p in prompts]


def encode_demonstration(tokenizer: Any, row: dict, chat_template: bool = False) -> tuple[list[int], list[int]]:
    """An SFT example as (prompt ids, response ids + eos): the loss covers the response part only."""
    prompt = encode_prompts(tokenizer, [row["prompt"]], chat_template)[0]
    return prompt, tokenizer.encode(row["response"]) + [tokenizer.eos_token_id]
