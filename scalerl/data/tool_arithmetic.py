"""The built-in tool task (``data.task=tool_arithmetic``): an operator the model has never seen, defined only by
a calculator tool, so a small model cannot answer in its head but can by calling the tool.

    a @ b = a*b + a + b        (`operator`; the tool `op` computes it)

Row format: the package's (`scalerl.data.arithmetic`), plus the operands::

    {"prompt": "Q:47@38\\nA:", "response": " #### 1871", "ground_truth": "1871", "difficulty": 2,
     "operands": [47, 38]}

``response`` is the direct answer (what a model without the tool is taught); `tool_demonstration` writes the
conversation with the tool instead: the call in the Hermes format the agent loop parses, the tool's result,
the final answer::

    user       Q:47@38\\nA:
    assistant  <tool_call>{"name":"op","arguments":{"a":47,"b":38}}</tool_call>
    tool       1871
    assistant   #### 1871

Levels are operand sizes: 1 single-digit (0-9), 2 two-digit (10-99), 3 three-digit (100-999). Train and test
never share a problem: the split of a problem is fixed by a CRC32 hash of its expression, as in the arithmetic
task. The reward (`tool_answer_reward`) is the exact final answer: the last ``#### <number>`` after the last
tool call, equal to the ground truth.
"""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from scalerl.data.answers import extract_hash_answer, same_number
from scalerl.data.arithmetic import _share_out
from scalerl.data.errors import DataError

TASK = "tool_arithmetic"
SPLITS = ("train", "test")
TEST_FRACTION = 0.2
OPERATOR_TEXT = "a @ b = a*b + a + b"
LEVEL_RANGES = {1: (0, 9), 2: (10, 99), 3: (100, 999)}
LEVEL_DESCRIPTIONS = {1: "single-digit operands", 2: "two-digit operands", 3: "three-digit operands"}
TOOL_NAME = "op"
TOOL_SPEC = "scalerl.data.tool_arithmetic:op"  # rollout.agent.tools
REWARD_SPEC = "scalerl.data.tool_arithmetic:tool_answer_reward"  # data.reward (what data.reward=auto uses)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_MAX_OPERAND = 10**6
# Levels up to this many problems are enumerated once per split; bigger ones are sampled by rejection.
_ENUMERATION_LIMIT = 50_000


def operator(a: int, b: int) -> int:
    """``a @ b``: what the tool computes and the ground truth is."""
    return a * b + a + b


def op(a: int, b: int) -> int:
    """Compute a @ b, the operator of the tool_arithmetic task.

    Args:
        a: The left operand, an integer.
        b: The right operand, an integer.
    """
    for name, value in (("a", a), ("b", b)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        if abs(value) >= _MAX_OPERAND:
            raise ValueError(f"{name}={value} is out of range (|{name}| < {_MAX_OPERAND})")
    return operator(a, b)


def _level_size(level: int) -> int:
    low, high = LEVEL_RANGES[level]
    return (high - low + 1) ** 2


def _operands(level: int, index: int) -> tuple[int, int]:
    low, high = LEVEL_RANGES[level]
    a, b = divmod(index, high - low + 1)
    return a + low, b + low


def _split_of(expression: str) -> str:
    return "test" if zlib.crc32(f"{TASK}:{expression}".encode()) % 1000 < TEST_FRACTION * 1000 else "train"


def _split_indices(level: int, split: str) -> list[int]:
    return [i for i in range(_level_size(level)) if _split_of("{}@{}".format(*_operands(level, i))) == split]


def count_tool_arithmetic_problems(split: str, level: int) -> int:
    """How many distinct problems ``level`` has in ``split`` (exact up to level 2, estimated above)."""
    if split not in SPLITS or level not in LEVEL_RANGES:
        raise DataError(f"unknown tool_arithmetic split {split!r} or level {level!r}")
    if _level_size(level) <= _ENUMERATION_LIMIT:
        return len(_split_indices(level, split))
    return int(_level_size(level) * (TEST_FRACTION if split == "test" else 1 - TEST_FRACTION))


def _draw(level: int, split: str, count: int, rng: random.Random) -> list[int]:
    if _level_size(level) <= _ENUMERATION_LIMIT:
        return rng.sample(_split_indices(level, split), count)
    chosen: list[int] = []
    seen: set[int] = set()
    while len(chosen) < count:
        index = rng.randrange(_level_size(level))
        if index not in seen:
            seen.add(index)
            if _split_of("{}@{}".format(*_operands(level, index))) == split:
                chosen.append(index)
    return chosen


def make_tool_arithmetic_rows(split: str, num_rows: int, difficulty: int | list[int], seed: int) -> list[dict]:
    """``num_rows`` distinct problems ``a@b`` of one split, shared out over the levels of ``difficulty`` in the
    list's proportions as in `scalerl.data.arithmetic.make_arithmetic_rows` (a level with too few problems
    passes the rest to the others). The same arguments always give the same rows in the same order."""
    if split not in SPLITS:
        raise DataError(f"tool_arithmetic split {split!r} is not one of {SPLITS}")
    levels = [difficulty] if isinstance(difficulty, int) and not isinstance(difficulty, bool) else difficulty
    if not isinstance(levels, (list, tuple)) or not levels or any(
            isinstance(level, bool) or level not in LEVEL_RANGES for level in levels):
        raise DataError(f"tool_arithmetic difficulty {difficulty!r} must be a level in {sorted(LEVEL_RANGES)} "
                        "or a list of them")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise DataError(f"num_rows={num_rows!r} must be a non-negative integer")
    weights = Counter(levels)
    capacities = {level: count_tool_arithmetic_problems(split, level) for level in weights}
    shares = _share_out(num_rows, weights, capacities)
    if sum(shares.values()) < num_rows:
        raise DataError(f"asked for {num_rows} {split} rows of tool_arithmetic difficulty {difficulty!r}, but there "
                        f"are only {sum(capacities.values())} distinct {split} problems; ask for fewer rows or add "
                        "levels")
    rows = []
    for level in sorted(shares):
        rng = random.Random(f"{TASK}:{split}:{level}:{seed}")
        for index in _draw(level, split, shares[level], rng):
            rows.append(tool_arithmetic_row(*_operands(level, index), level=level))
    random.Random(f"{TASK}-order:{split}:{seed}").shuffle(rows)
    return rows


def tool_arithmetic_row(a: int, b: int, level: int = 0) -> dict:
    answer = operator(a, b)
    return {"prompt": f"Q:{a}@{b}\nA:", "response": f" #### {answer}", "ground_truth": str(answer),
            "difficulty": level, "operands": [a, b]}


# ---- demonstrations of tool use (a scripted teacher) ---------------------------------------------------------

def tool_call_text(a: int, b: int) -> str:
    """The call in the Hermes format (compact JSON: fewer characters for a character-level model)."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def tool_demonstration(row: dict) -> list[dict]:
    """The scripted teacher's conversation for ``row``: the call, the tool's result (what `op` returns, as the
    tool environment writes it), the final answer."""
    a, b = row["operands"]
    return [{"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": tool_call_text(a, b)},
            {"role": "tool", "content": json.dumps(op(a, b))},
            {"role": "assistant", "content": f" #### {row['ground_truth']}"}]


def demonstration_sft_rows(messages: list[dict], end_of_turn: str) -> list[dict]:
    """One SFT row per assistant turn of a conversation, laid out as the agent loop lays out its tokens under
    the built-in tokenizer's template (message contents concatenated): the row's prompt is everything before
    the turn, each earlier assistant turn followed by ``end_of_turn`` (the eos the engine sampled to end it),
    and its response the turn (SFT appends the eos). The loss then covers the assistant's turns only: the
    user's prompt and the tool's result are prompt text, never trained on, as in the RL trajectory's mask."""
    rows, context = [], ""
    for message in messages:
        if message["role"] == "assistant":
            rows.append({"prompt": context, "response": message["content"]})
            context += message["content"] + end_of_turn
        else:
            context += message["content"]
    return rows


def chat_demonstration_sft_rows(messages: list[dict], tokenizer: Any, tools: list[dict] | None = None) -> list[dict]:
    """One SFT row per assistant turn of a conversation, laid out token for token as the agent loop lays out
    its tokens through ``tokenizer``'s chat template (`ChatContinuity`, as for a Qwen2.5-style instruct model):
    the messages before the first assistant turn rendered whole with ``tools`` and the generation prompt; each
    assistant turn its content's tokens + the eos the engine stops at; the messages after it (the tool's
    result) as the loop's delta (the template's glue after the eos, the new messages, the next generation
    prompt), never a re-render. A row's prompt is that layout's text before its turn, its response the turn's
    content (SFT appends the eos), so the loss covers the assistant's turns only.

    The rows are rendered already: train on them with ``data.chat_template=false`` (the trainer then adds only
    the tokenizer's BOS, which a prompt that the template began with a BOS leaves out here). Every row is
    encoded as the SFT trainer encodes it and compared with the loop's tokens; a tokenizer that re-encodes the
    text differently (a merge across a turn boundary) is a `DataError` naming the turn."""
    from scalerl.data.prompts import encode_demonstration
    from scalerl.rollout.agent.chat_delta import ChatContinuity

    roles = [m["role"] for m in messages]
    turns = [i for i, role in enumerate(roles) if role == "assistant"]
    if not turns or turns[0] == 0:
        raise DataError(f"a demonstration needs messages before its first assistant turn, got roles {roles}")
    for earlier, later in pairwise(turns):
        if later == earlier + 1:
            raise DataError(f"assistant turn {later} of the demonstration follows another assistant turn directly; "
                            "the agent loop ends an episode at an assistant turn that gets no reply")
    continuity, bos = ChatContinuity(tokenizer, tools), tokenizer.bos_token_id
    context = continuity.prompt(messages[:turns[0]])
    rows = []
    for turn_index, reply_end in zip(turns, turns[1:] + [None]):
        prompt_ids = context[1:] if bos is not None and context[:1] == [bos] else context
        content = messages[turn_index]["content"]
        turn = tokenizer.encode(content) + [tokenizer.eos_token_id]
        row = {"prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False), "response": content}
        if encode_demonstration(tokenizer, row, chat_template=False) != (context, turn):
            raise DataError(f"assistant turn {turn_index} of the demonstration: tokenizer "
                            f"{getattr(tokenizer, 'name_or_path', tokenizer)!r} does not encode the rendered text "
                            "as the agent loop lays out its tokens (a merge across a turn boundary, or a BOS the "
                            "template does not render), so SFT would train on tokens the loop never produces")
        rows.append(row)
        context = context + turn
        if reply_end is not None:  # the messages up to the next assistant turn, as the loop's delta
            context = context + continuity.continuation(messages[turn_index + 1:reply_end], turn[-1]).token_ids
    return rows


def tool_demonstration_rows(rows: list[dict], end_of_turn: str = "<eos>") -> list[dict]:
    """`tool_demonstration` for each row as SFT rows (two per problem: the call, then the answer after the
    result), each keeping its problem's ``ground_truth`` and the whole conversation (``messages``)."""
    out = []
    for row in rows:
        messages = tool_demonstration(row)
        for turn in demonstration_sft_rows(messages, end_of_turn):
            out.append({**turn, "ground_truth": row["ground_truth"], "messages": messages})
    return out


def chat_tool_demonstration_rows(rows: list[dict], tokenizer: Any,
                                 reset: Callable[[dict], tuple[list[dict], list[dict]]]) -> list[dict]:
    """`tool_demonstration` for each row as SFT rows rendered through ``tokenizer``'s chat template
    (`chat_demonstration_sft_rows`; train with ``data.chat_template=false``): the first messages and the tool
    schemas are what ``reset(row)`` gives (the tool environment's own ``reset``, so a system prompt and the
    tools match the RL run's), the teacher's turns follow. Each row keeps its ``ground_truth`` and the whole
    conversation (``messages``)."""
    out = []
    for row in rows:
        first, tools = reset(row)
        messages = list(first) + tool_demonstration(row)[1:]
        for turn in chat_demonstration_sft_rows(messages, tokenizer, tools):
            out.append({**turn, "ground_truth": row["ground_truth"], "messages": messages})
    return out


def direct_demonstration_rows(rows: list[dict]) -> list[dict]:
    """SFT rows answering directly, without the tool (the baseline's teacher): ``prompt`` -> ``" #### N"``."""
    return [{k: row[k] for k in ("prompt", "response", "ground_truth")} for row in rows]


# ---- the reward --------------------------------------------------------------------------------------------

def final_answer(text: str) -> str | None:
    """The final answer of an episode's text: the last ``#### <number>`` after its last tool call (a number
    inside a call, or the call's result, is not an answer); None when there is none."""
    return extract_hash_answer(text.rsplit(CALL_CLOSE, 1)[-1])


def tool_answer_reward(response: str, ground_truth: str) -> float:
    """1.0 when the episode's `final_answer` equals ``ground_truth`` as a number, else 0.0."""
    answer = final_answer(response)
    if answer is None:
        return 0.0
    match = same_number(answer, ground_truth.strip())
    return 1.0 if (match if match is not None else answer == ground_truth.strip()) else 0.0
