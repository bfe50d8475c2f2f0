"""The reward function signatures scalerl accepts, told apart by their parameter names, and how each is called.

    scalerl     fn(response, ground_truth)  (+ row= if it takes `row` or **kwargs)    one call per sample
    verl        compute_score(data_source, solution_str, ground_truth, extra_info=None)    one call per sample
    verl batch  compute_score(data_sources, solution_strs, ground_truths, extra_infos)   one call per batch
    trl         fn(prompts, completions, **columns) -> list[float | None]               one call per batch

A function naming `solution_strs` is verl's batched form, `solution_str` verl's, `completions` TRL's; any
other must take `(response, ground_truth)` positionally. verl's and TRL's arguments are passed by keyword,
as verl's reward managers and TRL's GRPOTrainer pass them, and only those the function declares (all of
them to a `**kwargs`). A score is a number, or a dict with a "score" number and extra numbers (verl's
reward managers log those; text values such as math_dapo's "pred" are not metrics and are dropped). For
TRL, `None` means "does not apply to this sample"; for the others it is a failure, as any non-number is.

`reward_inputs(row)` is the one place that knows which row keys hold what a reward is given.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from scalerl.core.errors import UserError

STYLES = ("scalerl", "verl", "verl_batch", "trl")
SIGNATURES = {
    "scalerl": "fn(response, ground_truth, row=None)",
    "verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None)",
    "verl_batch": "compute_score(data_sources, solution_strs, ground_truths, extra_infos)",
    "trl": "fn(prompts, completions, **columns) -> list[float | None]",
}
_VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
_VERL_BATCH_KEYWORDS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
_TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
# Row keys that are the sample itself rather than a column a TRL reward could ask for.
_NOT_COLUMNS = ("prompt", "response", "completion", "columns")


class RewardFunctionError(UserError, ValueError):
    """A reward spec that names no usable function; the message names the spec and what is missing."""


@dataclass(frozen=True)
class RewardInputs:
    """What one data row gives a reward function."""

    prompt: Any  # text, or chat messages (TRL's conversational rows)
    ground_truth: Any
    data_source: str | None
    extra_info: dict | None
    columns: dict[str, Any]  # TRL's extra dataset columns, passed as keyword arguments
    has_ground_truth: bool


def reward_inputs(row: dict) -> RewardInputs:
    """The reward's view of `row`: verl rows keep `data_source`, `ground_truth` (or verl's own
    `reward_model.ground_truth`) and `extra_info`; TRL rows their extra columns under `columns` (without
    it, every key but the prompt and response is a column)."""
    reward_model = row.get("reward_model")
    if "ground_truth" in row:
        has_truth, truth = True, row["ground_truth"]
    elif isinstance(reward_model, dict) and "ground_truth" in reward_model:
        has_truth, truth = True, reward_model["ground_truth"]
    else:
        has_truth, truth = False, None
    columns = row["columns"] if isinstance(row.get("columns"), dict) else {
        key: value for key, value in row.items() if key not in _NOT_COLUMNS}
    return RewardInputs(row.get("prompt"), truth, row.get("data_source"), row.get("extra_info"), dict(columns),
                        has_truth)


@dataclass
class Score:
    """One sample's result from one function: the score (None: not applicable, TRL), its extra numbers, or
    `problem` (what was wrong with the returned value) when it is unusable."""

    value: float | None = None
    extras: dict[str, float] = field(default_factory=dict)
    problem: str | None = None
    kind: str = ""  # the kind of problem, so that each kind is logged once


class RewardFunction:
    """A user's (or built-in) reward function with its calling convention, detected from its signature."""

    def __init__(self, fn: Callable, spec: str | None = None, name: str | None = None):
        if not callable(fn):
            raise RewardFunctionError(f"reward function {spec or fn!r} is not callable")
        self.fn, self.spec = fn, spec
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.style, self.parameters, self.takes_any_keyword = _detect_style(fn, spec or self.name)
        self.per_sample = self.style in ("scalerl", "verl")
        self.passes_row = self.style == "scalerl" and ("row" in self.parameters or self.takes_any_keyword)

    def sample_call(self, response: str, row: dict) -> tuple[tuple, dict]:
        """The arguments of the call scoring one sample (per-sample styles)."""
        inputs = reward_inputs(row)
        if self.style == "scalerl":
            return (response, inputs.ground_truth), ({"row": row} if self.passes_row else {})
        given = dict(zip(_VERL_KEYWORDS, (inputs.data_source, response, inputs.ground_truth, inputs.extra_info)))
        return (), self._declared(given)

    def batch_call(self, responses: Sequence[str], rows: Sequence[dict],
                   completion_ids: Sequence[Sequence[int]] | None = None) -> tuple[tuple, dict]:
        """The arguments of the one call scoring a whole batch (batched styles)."""
        inputs = [reward_inputs(row) for row in rows]
        if self.style == "verl_batch":
            columns = ([i.data_source for i in inputs], list(responses), [i.ground_truth for i in inputs],
                       [i.extra_info if i.extra_info is not None else {} for i in inputs])
            return (), self._declared(dict(zip(_VERL_BATCH_KEYWORDS, columns)))
        prompts = [i.prompt for i in inputs]
        conversational = bool(prompts) and isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": text}] for text in responses] if conversational \
            else list(responses)
        given: dict[str, Any] = {"prompts": prompts, "completions": completions}
        if completion_ids is not None:
            given["completion_ids"] = [list(ids) for ids in completion_ids]
        column_names = sorted({name for i in inputs for name in i.columns} - set(given))
        for name in column_names:
            given[name] = [i.columns.get(name) for i in inputs]
        missing = self._required_beyond(given)
        if missing:
            raise RewardFunctionError(
                f"reward {self.name} needs {', '.join(map(repr, missing))}, which the rows do not give "
                f"(columns: {column_names or 'none'}; TRL rewards get prompts, completions and the dataset's "
                "extra columns)")
        return (), self._declared(given)

    def missing_inputs(self, row: dict) -> list[str]:
        """What this function needs that ``row`` does not give: ``ground_truth`` for scalerl-style functions,
        the required parameters beyond prompts, completions and the row's columns for TRL's."""
        inputs = reward_inputs(row)
        if self.style == "scalerl":
            return [] if inputs.has_ground_truth else ["ground_truth"]
        if self.style == "trl":
            return self._required_beyond(set(_TRL_KEYWORDS) | set(inputs.columns))
        return []

    def _required_beyond(self, given) -> list[str]:
        return [name for name, p in self.parameters.items() if name not in given and p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def _declared(self, given: dict[str, Any]) -> dict[str, Any]:
        if self.takes_any_keyword:
            return given
        return {key: value for key, value in given.items() if key in self.parameters}


def _detect_style(fn: Callable, spec: str) -> tuple[str, dict[str, inspect.Parameter], bool]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no inspectable signature; trust them
        return "scalerl", {}, False
    parameters = dict(signature.parameters)
    any_keyword = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    named = {name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for style, keywords in (("verl_batch", _VERL_BATCH_KEYWORDS), ("verl", _VERL_KEYWORDS),
                            ("trl", _TRL_KEYWORDS[:2])):
        if keywords[1] in named:
            passed = {k: None for k in keywords if k in named or any_keyword}
            try:  # TRL's columns are known only once rows come
                (signature.bind_partial if style == "trl" else signature.bind)(**passed)
            except TypeError as error:
                raise _no_signature(spec, fn, signature, error) from error
            return style, parameters, any_keyword
    row = {"row": {}} if "row" in named or any_keyword else {}
    try:
        signature.bind("response", "ground_truth", **row)
    except TypeError as error:
        raise _no_signature(spec, fn, signature, error) from error
    return "scalerl", parameters, any_keyword


def _no_signature(spec: str, fn: Callable, signature: inspect.Signature, error: TypeError) -> RewardFunctionError:
    accepted = "; ".join(f"{style}: {text}" for style, text in SIGNATURES.items())
    name = getattr(fn, "__name__", type(fn).__name__)
    return RewardFunctionError(f"reward {spec!r}: {name}{signature} must accept one of these signatures ({accepted}): "
                               f"{error}")


def read_score(value: Any, none_means_not_applicable: bool = False) -> Score:
    """A returned value as a `Score`: a finite number, or a dict with a finite "score" (its other finite
    numbers and bools become extras, other values are dropped)."""
    if value is None and none_means_not_applicable:
        return Score()
    extras: dict[str, float] = {}
    number = value
    if isinstance(value, dict):
        if "score" not in value:
            return Score(problem=f"returned a dict without a 'score' key (keys: {sorted(map(str, value))[:8]})",
                         kind="returned a dict without 'score'")
        number = value["score"]
        extras = {str(k): float(v) for k, v in value.items() if k != "score" and finite_number(v) is not None}
    score = finite_number(number)
    if score is None:
        kind = f"returned {number!r}" if _is_number(number) else f"returned {type(number).__name__}"
        return Score(problem=f"returned {number!r:.80} instead of a finite number", kind=kind)
    return Score(score, extras)


def finite_number(value: Any) -> float | None:
    """`value` as a finite float (bools, NumPy numbers and 1-element tensors too); None otherwise."""
    if not _is_number(value):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) or (
        hasattr(value, "__float__") and not isinstance(value, (str, bytes))  # e.g. a 1-element tensor
    )
