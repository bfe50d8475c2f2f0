"""Reward functions: the built-in GSM8K and MATH checkers, user functions by name, and failure-safe scoring.

A reward function is any callable `fn(response: str, ground_truth: str) -> float` (a `bool` or
NumPy number is fine too). If it also accepts a keyword argument `row` (or `**kwargs`), it receives the
whole data row, so it can use extra fields. Name one in a config with `load_reward_fn`:

    "gsm8k"                         exact numeric match of the last `#### <number>`
    "math"                          match of the last `\\boxed{...}` after light normalization
    "my_package.rewards:score"      a function in an importable module
    "path/to/rewards.py:score"      a function in a Python file

`RewardComputer` calls the function once per sample; a call that raises, calls `sys.exit`, runs longer
than its limit (`data.reward_timeout_s`), or returns something that is not a finite number, scores 0.0 and is
counted (`reward/num_failures` in the trainer's metrics) and logged once per kind of failure, so one bad
sample never stops or hangs a run.

A "module:function" spec is imported with the current directory first on `sys.path` (put there once, as
`python -m` does), so `scalerl ...` and `python -m scalerl ...` import the same module, and the module's own
imports of files beside it work under both; a "file.py:function" path is relative to the current directory.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from scalerl.core.errors import UserError
from scalerl.data.answers import (
    extract_boxed,
    extract_hash_answer,
    normalize_math_answer,
    same_number,
)
from scalerl.data.errors import DataError
from scalerl.data.reward_calls import RewardExit, RewardTimeout, call_with_limit

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]


class RewardFunctionError(UserError, ValueError):
    """A reward spec that names no usable function; the message names the spec and what is missing."""


def gsm8k_reward(response: str, ground_truth: str, format_score: float = 0.0) -> float:
    """1.0 when the last `#### <number>` of `response` equals `ground_truth` as a number, else 0.0.

    `ground_truth` is a number ("1,234" and "1234.0" are fine) or a full GSM8K answer ending in `####`.
    `format_score` is given instead of 0.0 to a response that has a `####` answer that is wrong.
    """
    answer = extract_hash_answer(response)
    if answer is None:
        return 0.0
    expected = extract_hash_answer(ground_truth) if "####" in ground_truth else ground_truth.strip()
    match = same_number(answer, expected)
    correct = match if match is not None else answer == expected
    return 1.0 if correct else float(format_score)


def math_reward(response: str, ground_truth: str, format_score: float = 0.0) -> float:
    """1.0 when the last `\\boxed{...}` of `response` matches `ground_truth` after `normalize_math_answer`.

    `ground_truth` is the answer itself or a MATH solution containing `\\boxed{...}`. Numbers compare by
    value (`5` == `5.0`), everything else as normalized strings, so `0.5` vs `\\frac{1}{2}` scores 0.
    `format_score` is given instead of 0.0 to a response that has a boxed answer that is wrong.
    """
    answer = extract_boxed(response)
    if answer is None:
        return 0.0
    expected = extract_boxed(ground_truth) if "\\boxed" in ground_truth or "\\fbox" in ground_truth else ground_truth
    if expected is None:
        raise ValueError(f"ground truth {ground_truth[:80]!r} has an unclosed \\boxed{{...}}")
    answer, expected = normalize_math_answer(answer), normalize_math_answer(expected)
    correct = answer == expected or bool(same_number(answer, expected))
    return 1.0 if correct else float(format_score)


BUILTIN_REWARDS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward, "math": math_reward}


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function named by `spec`: "gsm8k", "math", "module:function" or "path/to/file.py:function".

    Raises `RewardFunctionError` naming the spec when the module, file or function is missing, the
    file fails to import, or the object is not callable with `(response, ground_truth)`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(f"reward spec {spec!r} must be a non-empty string such as 'gsm8k'")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardFunctionError(
            f"reward {spec!r} is not a built-in ({', '.join(BUILTIN_REWARDS)}) and not of the form "
            f"'module:function' or 'path/to/file.py:function'"
        )
    target, name = spec.rsplit(":", 1)
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _import_file(Path(target), spec) if is_file else _import_module(target, spec)
    fn = getattr(module, name, None)
    if fn is None:
        available = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith("_"))
        raise RewardFunctionError(f"reward {spec!r}: {target} has no attribute {name!r} (callables there: {available})")
    if not callable(fn):
        raise RewardFunctionError(f"reward {spec!r}: {name} is a {type(fn).__name__}, not a function")
    try:
        row_keyword = {"row": {}} if _accepts_row_keyword(fn) else {}
        inspect.signature(fn).bind("response", "ground_truth", **row_keyword)
    except TypeError as error:
        raise RewardFunctionError(
            f"reward {spec!r}: {name} must accept (response, ground_truth) positionally, "
            f"plus optionally row=: {error}"
        ) from error
    except ValueError:  # some builtins have no inspectable signature; trust them
        pass
    return fn


class RewardComputer:
    """Scores a batch of responses with one reward function, never letting a failing sample crash the run.

    `compute(responses, rows)` returns `(rewards, num_failures)`: one float per response and how many
    samples failed (the function raised, called sys.exit, took longer than `timeout_s`, or returned a
    non-number, NaN or inf) and so got 0.0. Each kind of failure is logged once per `RewardComputer`, with
    its traceback, not once per sample.
    """

    def __init__(self, reward_fn: RewardFn | str, timeout_s: float = 30.0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.reward_fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        if not callable(self.reward_fn):
            raise RewardFunctionError(f"reward function {reward_fn!r} is not callable")
        self.name = getattr(self.reward_fn, "__qualname__", repr(self.reward_fn))
        self.passes_row = _accepts_row_keyword(self.reward_fn)
        self.total_failures = 0
        self._logged_failure_kinds: set[str] = set()

    def compute(self, responses: Sequence[str], rows: Sequence[dict]) -> tuple[list[float], int]:
        """One reward per response; `rows[i]` is the data row (with "ground_truth") that `responses[i]` answers."""
        if len(responses) != len(rows):
            raise ValueError(f"got {len(responses)} responses but {len(rows)} rows; pass one row per response")
        rewards, failures = [], 0
        for index, (response, row) in enumerate(zip(responses, rows)):
            if "ground_truth" not in row:
                raise DataError(f"row {index} given to reward {self.name} has no 'ground_truth' (keys: {sorted(row)})")
            reward = self._score(response, row)
            if reward is None:
                failures += 1
                reward = 0.0
            rewards.append(reward)
        self.total_failures += failures
        return rewards, failures

    def _score(self, response: str, row: dict) -> float | None:
        """The reward of one sample, or None (after logging the first of its kind) when the function failed."""
        kwargs = {"row": row} if self.passes_row else {}
        try:
            value = call_with_limit(self.reward_fn, (response, row["ground_truth"]), kwargs, self.timeout_s)
        except (RewardTimeout, RewardExit) as error:  # no traceback: the message says it all
            self._log_failure(type(error).__name__, str(error), response)
            return None
        except Exception as error:  # any user bug: score 0, count, carry on
            self._log_failure(type(error).__name__, f"raised {error!r}", response, exc_info=True)
            return None
        number = _finite_float(value)
        if number is None:
            kind = f"returned {type(value).__name__}" if not _is_number(value) else f"returned {value!r}"
            self._log_failure(kind, f"returned {value!r:.80} instead of a finite number", response)
        return number

    def _log_failure(self, kind: str, what: str, response: str, exc_info: bool = False) -> None:
        if kind in self._logged_failure_kinds:
            return
        self._logged_failure_kinds.add(kind)
        logger.warning(
            "reward function %s %s for response %r; scoring it 0.0 (counted in reward/num_failures, "
            "further %s failures are not logged)",
            self.name, what, response[:120], kind, exc_info=exc_info,
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) or (
        hasattr(value, "__float__") and not isinstance(value, (str, bytes))  # e.g. a 1-element tensor
    )


def _finite_float(value: Any) -> float | None:
    if not _is_number(value):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _accepts_row_keyword(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        (parameter.name == "row" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY))
        or parameter.kind == parameter.VAR_KEYWORD
        for parameter in parameters
    )


def _import_module(module_name: str, spec: str) -> Any:
    cwd = os.getcwd()
    if not sys.path or os.path.abspath(sys.path[0] or os.curdir) != cwd:
        sys.path.insert(0, cwd)  # the documented rule: the current directory first, under every entry point
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise RewardFunctionError(
                f"reward {spec!r}: no module named {module_name!r} (is it installed or on PYTHONPATH? "
                f"for a file write 'path/to/file.py:function')"
            ) from error
        raise RewardFunctionError(f"reward {spec!r}: importing {module_name} failed: {error}") from error
    except Exception as error:
        raise RewardFunctionError(f"reward {spec!r}: importing {module_name} failed: {error!r}") from error


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise RewardFunctionError(f"reward {spec!r}: file {str(path)!r} does not exist (relative to {Path.cwd()})")
    resolved = path.resolve()
    # A stable, unique module name per file, so two files both called rewards.py do not collide.
    module_name = f"scalerl_user_reward_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise RewardFunctionError(f"reward {spec!r}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise RewardFunctionError(f"reward {spec!r}: running {path} failed: {error!r}") from error
    return module


__all__ = [
    "BUILTIN_REWARDS",
    "RewardComputer",
    "RewardFn",
    "RewardFunctionError",
    "extract_boxed",
    "extract_hash_answer",
    "gsm8k_reward",
    "load_reward_fn",
    "math_reward",
    "normalize_math_answer",
]
