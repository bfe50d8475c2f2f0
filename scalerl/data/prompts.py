"""Prompts and demonstrations as token ids, and the check that every row of a data set can be encoded."""

from __future__ import annotations

from typing import Any

from scalerl.data.errors import DataError
from scalerl.models.tokenizer import TokenizerError


def encode_prompts(tokenizer: Any, prompts: list[str | list[dict]], chat_template: bool = False) -> list[list[int]]:
    """Prompt token ids. Text: the tokenizer's BOS (when it has one) + the text; with ``chat_template``, the
    text becomes one user message rendered by the tokenizer's chat template with the generation prompt
    appended (instruct models), and the template supplies its own special tokens, so no BOS is added.
    Chat messages (verl's and TRL's conversational prompts) always go through the chat template that way.
    The built-in character tokenizer's template is the messages' contents joined, roles dropped."""
    return [_encode_prompt(tokenizer, prompt, chat_template) for prompt in prompts]


def _encode_prompt(tokenizer: Any, prompt: str | list[dict], chat_template: bool) -> list[int]:
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TokenizerError(
                f"this prompt is a list of chat messages, which needs the tokenizer's chat template, but tokenizer "
                f"{getattr(tokenizer, 'name_or_path', tokenizer)!r} has none: use an instruct model's tokenizer "
                "(model.tokenizer=<directory>), add `chat_template` to its tokenizer_config.json, or give text "
                "prompts"
            )
        return tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    if chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                              add_generation_prompt=True))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(prompt)


def prompt_preview(prompt: str | list[dict], width: int = 80) -> str:
    """The start of a prompt for an error message: the text, or the last message's content."""
    text = prompt if isinstance(prompt, str) else f"[{prompt[-1]['role']}] {prompt[-1]['content']}"
    return repr(text[:width])


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
                            f"data.max_prompt_length={max_length}: {prompt_preview(row['prompt'])}; raise "
                            "data.max_prompt_length or shorten the prompts")


def encode_demonstrations(tokenizer: Any, rows: list[dict], chat_template: bool,
                          max_positions: int, source: str = "the SFT data") -> list[tuple[list[int], list[int]]]:
    """`encode_demonstration` for every row; a row the tokenizer cannot encode, without a response, or
    longer than the model's positions is an error naming it (``source``: where the rows were read)."""
    examples = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get("response"), str):
            raise DataError(f"SFT row {number} of {source} has no 'response' text to train on (a 'response' "
                            f"column, TRL's 'completion', or GSM8K's 'answer'): {prompt_preview(row['prompt'])}")
        try:
            prompt, response = encode_demonstration(tokenizer, row, chat_template)
        except TokenizerError as e:
            raise DataError(f"SFT row {number}: {e}") from None
        if len(prompt) + len(response) > max_positions:
            raise DataError(f"SFT row {number}: prompt + response = {len(prompt)} + {len(response)} tokens exceeds "
                            f"the model's {max_positions} positions: {prompt_preview(row['prompt'], 60)}; shorten or "
                            "drop it")
        examples.append((prompt, response))
    return examples
