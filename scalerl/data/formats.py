"""Records -> rows: each data file format's columns, how its format is told from them, and chat messages.

Formats (`data.format`; "auto" tells them from a file's columns, in the order of `detection_order`):

    gsm8k  {"question", "answer"}   the answer ends in "#### <number>"
           -> prompt = template(question), response = " " + answer, ground_truth = the number
    math   {"problem", "solution"}  the solution holds "\\boxed{...}"; an "answer" field, where present (as
           in MATH-500), is the ground truth instead -> prompt = template(problem), response = " " + solution
    rows   {"prompt", "ground_truth"} and optionally "response": every field passed through as it is
    verl   {"prompt", "reward_model"}: verl's schema, as its `examples/data_preprocess/*.py` write it and its
           `RLHFDataset` reads it: "data_source", "prompt" (chat messages), "ability",
           "reward_model": {"style", "ground_truth"}, "extra_info": {...}
    trl    {"prompt"}: TRL's standard ("prompt" text, optional "completion" text) or conversational
           ("prompt" messages, optional "completion" assistant messages) datasets; any other columns

`ColumnNames` renames columns as verl's config does: `data.prompt_key` (the prompt of rows/verl/trl),
`data.ground_truth_key` (dotted for a nested field; default "reward_model.ground_truth" for verl,
"ground_truth" otherwise) and `data.reward_fn_key` (verl's: the column handed to the reward as
`data_source`).

A prompt is text or chat messages: a non-empty list of {"role", "content"} with a role in `MESSAGE_ROLES` and
text content. Parquet stores a list of messages as structs, which fills each message's missing fields
with null; those nulls are dropped, so every message reads back as it was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalerl.data.answers import extract_boxed, extract_hash_answer
from scalerl.data.errors import DataError

FORMATS = ("auto", "gsm8k", "math", "rows", "verl", "trl")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
TRL_COMPLETION = "completion"  # TRL's fixed column name for the reference completion


@dataclass(frozen=True)
class ColumnNames:
    """Which columns hold the prompt, the ground truth and verl's data source."""

    prompt: str = "prompt"
    ground_truth: str | None = None  # dotted; None = the format's own
    data_source: str = "data_source"

    def ground_truth_for(self, format_name: str) -> str:
        return self.ground_truth or ("reward_model.ground_truth" if format_name == "verl" else "ground_truth")

    def needed(self, format_name: str) -> tuple[str, ...]:
        """The top-level columns that identify `format_name` in a file."""
        return {
            "verl": (self.prompt, "reward_model"),
            "rows": (self.prompt, "ground_truth"),  # the native format's own column, whatever ground_truth says
            "gsm8k": ("question", "answer"),
            "math": ("problem", "solution"),
            "trl": (self.prompt,),
        }[format_name]


def detection_order(preferred: str | None) -> tuple[str, ...]:
    """The formats "auto" tries, in order. A task's own format (`data.task=gsm8k` or `math`) goes first and
    the other task's is not tried, so a math file is not scored by the gsm8k reward."""
    if preferred in ("gsm8k", "math"):
        return (preferred, "verl", "rows", "trl")
    return ("verl", "rows", "gsm8k", "math", "trl")


def detect_format(path: Path, columns: set[str], names: ColumnNames, preferred: str | None) -> str:
    """The format of a file whose records have `columns`; with none matching, the task's own format (so the
    error names the field it misses), or an error listing what each format needs."""
    order = detection_order(preferred)
    for format_name in order:
        if set(names.needed(format_name)) <= columns:
            return format_name
    if preferred in ("gsm8k", "math"):
        return preferred
    expected = "; ".join(f"{name}: {', '.join(names.needed(name))}" for name in order)
    raise DataError(f"{path}: cannot tell the data kind from its fields {sorted(columns)}; expected ({expected}), "
                    "or set data.format (and data.prompt_key / data.ground_truth_key for other column names)")


class RowContext:
    """One input record and where it came from, so every error can name the file, the row and the field."""

    def __init__(self, path: Path, number: int, record: dict[str, Any]):
        self.path, self.number, self.record = path, number, record

    def error(self, message: str) -> DataError:
        return DataError(f"{self.path}, row {self.number}: {message}")

    def missing(self, field: str, kind: str) -> DataError:
        present = sorted(key for key, value in self.record.items() if value is not None)
        return self.error(f"missing field {field!r} needed for {kind} rows (fields present: {present})")

    def field(self, dotted: str, kind: str) -> Any:
        """The value at `dotted` ("reward_model.ground_truth" reads a nested field); missing or null raises."""
        value: Any = self.record
        for depth, part in enumerate(dotted.split(".")):
            if depth and not isinstance(value, dict):
                parent = ".".join(dotted.split(".")[:depth])
                raise self.error(f"field {parent!r} should be a dict holding {part!r}, got "
                                 f"{type(value).__name__} {value!r:.60}")
            value = value.get(part)
            if value is None:
                raise self.missing(dotted, kind)
        return value

    def text_field(self, field: str, kind: str) -> str:
        """The text in `field`; a missing (or null) field or a non-text value raises `DataError`."""
        value = self.field(field, kind)
        if not isinstance(value, str):
            raise self.error(f"field {field!r} should be text, got {type(value).__name__} {value!r:.60}")
        return value

    def optional(self, field: str, kinds: tuple[type, ...]) -> Any:
        """A field that may be absent (None); present, it must be one of `kinds`."""
        value = self.record.get(field)
        if value is not None and not isinstance(value, kinds):
            wanted = " or ".join({str: "text", dict: "a dict", list: "a list"}.get(kind, kind.__name__)
                                 for kind in kinds)
            raise self.error(f"field {field!r} should be {wanted}, got {type(value).__name__} {value!r:.60}")
        return value

    def prompt(self, field: str, kind: str) -> str | list[dict[str, str]]:
        """Text, or chat messages (checked, nulls dropped)."""
        value = self.field(field, kind)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return self.messages(value, field)
        raise self.error(f"field {field!r} should be text or a list of chat messages [{{'role': 'user', "
                         f"'content': '...'}}], got {type(value).__name__} {value!r:.60}")

    def messages(self, value: list, field: str, roles: tuple[str, ...] = MESSAGE_ROLES) -> list[dict[str, str]]:
        if not value:
            raise self.error(f"field {field!r} is an empty list of chat messages")
        messages = []
        for index, message in enumerate(value):
            where = f"{field}[{index}]"
            if not isinstance(message, dict):
                raise self.error(f"field {where!r} should be a chat message {{'role', 'content'}}, got "
                                 f"{type(message).__name__} {message!r:.60}")
            message = {key: item for key, item in message.items() if item is not None}
            role, content = message.get("role"), message.get("content")
            if role not in roles:
                raise self.error(f"field '{where}.role' is {role!r}; a chat message's role is one of {roles}")
            if not isinstance(content, str):
                got = "missing" if content is None else f"{type(content).__name__} {content!r:.60}"
                raise self.error(f"field '{where}.content' should be text (multimodal content parts are not "
                                 f"supported), got {got}")
            messages.append(message)
        return messages


def gsm8k_row(row: RowContext, template: str, names: ColumnNames) -> dict:
    question, answer = row.text_field("question", "gsm8k"), row.text_field("answer", "gsm8k")
    ground_truth = extract_hash_answer(answer)
    if ground_truth is None:
        raise row.error(f"field 'answer' has no '#### <number>' final answer: {answer[-80:]!r}")
    return {"prompt": template.format(question=question), "response": " " + answer, "ground_truth": ground_truth}


def math_row(row: RowContext, template: str, names: ColumnNames) -> dict:
    problem, solution = row.text_field("problem", "math"), row.text_field("solution", "math")
    ground_truth = row.record.get("answer")
    if ground_truth is None:
        ground_truth = extract_boxed(solution)
        if ground_truth is None:
            raise row.error(f"field 'solution' has no complete \\boxed{{...}} answer: {solution[-80:]!r}")
    elif not isinstance(ground_truth, str):
        ground_truth = str(ground_truth)
    return {"prompt": template.format(question=problem), "response": " " + solution, "ground_truth": ground_truth}


def passthrough_row(row: RowContext, template: str, names: ColumnNames) -> dict:
    converted = dict(row.record)
    converted["prompt"] = row.prompt(names.prompt, "prompt/ground_truth")
    converted["ground_truth"] = row.text_field(names.ground_truth_for("rows"), "prompt/ground_truth")
    if converted.get("response") is None:
        converted.pop("response", None)
    return converted


def verl_row(row: RowContext, template: str, names: ColumnNames) -> dict:
    """verl's fields under verl's names; `extra_info` is {} when absent, as verl's `RLHFDataset` makes it."""
    prompt = row.prompt(names.prompt, "verl")
    reward_model = row.optional("reward_model", (dict,))
    ground_truth = row.field(names.ground_truth_for("verl"), "verl")  # as written: verl's rewards take any type
    extra_info = row.optional("extra_info", (dict,))
    return {
        "prompt": prompt, "ground_truth": ground_truth,
        "data_source": row.optional(names.data_source, (str,)), "ability": row.optional("ability", (str,)),
        "reward_model": reward_model, "extra_info": {} if extra_info is None else extra_info,
        "columns": {key: value for key, value in row.record.items() if key != names.prompt},
    }


def trl_row(row: RowContext, template: str, names: ColumnNames) -> dict:
    """The prompt, the completion as "response", the ground truth where there is one, and the other columns
    (what TRL's GRPOTrainer passes to reward functions as keyword arguments) under "columns"."""
    converted: dict[str, Any] = {"prompt": row.prompt(names.prompt, "trl")}
    completion = row.record.get(TRL_COMPLETION)
    if isinstance(completion, list):  # conversational: the assistant's reply, as text
        messages = row.messages(completion, TRL_COMPLETION, roles=("assistant",))
        converted["response"] = "".join(message["content"] for message in messages)
    elif completion is not None:
        converted["response"] = row.text_field(TRL_COMPLETION, "trl")
    if names.ground_truth is not None:  # asked for: it must be there
        converted["ground_truth"] = row.field(names.ground_truth, "trl")
    elif row.record.get("ground_truth") is not None:
        converted["ground_truth"] = row.record["ground_truth"]
    converted["columns"] = {key: value for key, value in row.record.items()
                            if key not in (names.prompt, TRL_COMPLETION)}
    return converted


CONVERTERS = {"gsm8k": gsm8k_row, "math": math_row, "rows": passthrough_row, "verl": verl_row, "trl": trl_row}
OWN_PROMPT_FORMATS = ("rows", "verl", "trl")  # their records hold the prompt: a template would do nothing


def reward_columns(row: dict) -> dict[str, Any]:
    """The keyword arguments a TRL-style reward function gets for `row`: its dataset's columns other than
    the prompt and the completion (`row["columns"]`, verl and TRL rows), else the row's fields other than
    "prompt" and "response" (the ground truth, and a rows file's extra fields)."""
    if "columns" in row:
        return dict(row["columns"])
    return {key: value for key, value in row.items() if key not in ("prompt", "response")}
