"""Prompts and demonstrations as token ids, and the check that every row of a data set can be encoded."""

from __future__ import annotations

from typing import Any

from scalerl.data.errors import DataError
from scalerl.models.tokenizer import TokenizerError


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


def check_prompts(tokenizer: Any, rows: list[dict], chat_template: bool, max_length: int, split: str) -> None:
    """Encode every prompt of `rows` once, before training: text the tokenizer cannot encode, or a prompt
    longer than `data.max_prompt_length`, fails at start naming the row instead of at some later step."""
    for number, row in enumerate(rows, start=1):
        try:
            (ids,) = encode_prompts(tokenizer, [row["prompt"]], chat_template)
        except TokenizerError as e:
            raise DataError(f"{split} row {number}: {e}") from None
        if len(ids) > max_length:
            raise DataError(f"{split} row {number}: its prompt has {len(ids)} tokens, more than "
                            f"data.max_prompt_length={max_length}: {row['prompt'][:80]!r}; raise "
                            "data.max_prompt_length or shorten the prompts")


def encode_demonstrations(tokenizer: Any, rows: list[dict], chat_template: bool,
                          max_positions: int) -> list[tuple[list[int], list[int]]]:
    """`encode_demonstration` for every row; a row the tokenizer cannot encode, without a response, or
    longer than the model's positions is an error naming it."""
    examples = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get("response"), str):
            raise DataError(f"SFT row {number} has no 'response' text to train on: {row.get('prompt', '')[:80]!r}")
        try:
            prompt, response = encode_demonstration(tokenizer, row, chat_template)
        except TokenizerError as e:
            raise DataError(f"SFT row {number}: {e}") from None
        if len(prompt) + len(response) > max_positions:
            raise DataError(f"SFT row {number}: prompt + response = {len(prompt)} + {len(response)} tokens exceeds "
                            f"the model's {max_positions} positions: {row['prompt'][:60]!r}; shorten or drop it")
        examples.append((prompt, response))
    return examples
