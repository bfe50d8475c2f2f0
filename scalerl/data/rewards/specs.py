"""Built-in rewards and reward specs: the GSM8K and MATH checkers, and user functions named in a config.

`load_reward_fn(spec)` gives the function a spec names; `load_reward_fns(spec, task)` the functions of a
comma-separated list of specs (`data.reward=a.py:format,a.py:accuracy`), each with its calling convention
(`scalerl.data.rewards.functions`):

    "gsm8k"                         exact numeric match of the last `#### <number>`
    "math"                          match of the last `\\boxed{...}` after light normalization
    "auto"                          verl's default scorer for a row's `data_source`; rows without one:
                                    the task's built-in (`TASK_REWARDS`); only in `load_reward_fns`
    "my_package.rewards:score"      a function in an importable module
    "path/to/rewards.py:score"      a function in a Python file
    "http://127.0.0.1:8000/score"   a reward server (`scalerl.data.rewards.http`); only in `load_reward_fns`

A "module:function" spec is imported with the current directory first on `sys.path` (put there once, as
`python -m` does), so `scalerl ...` and `python -m scalerl ...` import the same module, and the module's own
imports of files beside it work under both; a "file.py:function" path is relative to the current directory.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from scalerl.data.answers import (
    extract_boxed,
    extract_hash_answer,
    normalize_math_answer,
    same_number,
)
from scalerl.data.errors import DataError
from scalerl.data.rewards.functions import (
    RewardFunction,
    RewardFunctionError,
    reward_inputs,
)
from scalerl.data.rewards.http import ServerReward
from scalerl.data.rewards.verl_scorers import (
    UnknownDataSource,
    default_compute_score,
    is_known_data_source,
    unknown_data_source_message,
)

RewardFn = Callable[..., float]
USER_MODULE_PREFIX = "scalerl_user_reward_"  # the module of a "file.py:function" spec's file


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
    file fails to import, or the object fits none of the accepted signatures (the message lists them).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(f"reward spec {spec!r} must be a non-empty string such as 'gsm8k'")
    spec = spec.strip()
    if "," in spec:
        raise RewardFunctionError(f"reward spec {spec!r} names several functions; load them with load_reward_fns")
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
    RewardFunction(fn, spec, name)  # one of the accepted signatures, or an error naming them
    return fn


TASK_REWARDS = {"arithmetic": "gsm8k", "gsm8k": "gsm8k", "math": "math"}  # data.reward=auto for rows without a source


class ScoreByDataSource:
    """`data.reward=auto`: verl's `default_compute_score` for a row with a `data_source`, `fallback` (the
    task's built-in reward) for a row without one."""

    def __init__(self, fallback: RewardFn | None):
        self.fallback = fallback
        self.__name__ = "auto"

    def __call__(self, response: str, ground_truth: Any, row: dict) -> float | dict:
        inputs = reward_inputs(row)
        if inputs.data_source is None:
            if self.fallback is None:
                raise DataError(f"data.reward=auto: a row without 'data_source' (keys: {sorted(row)}) and no task reward")
            return self.fallback(response, ground_truth)
        return default_compute_score(inputs.data_source, response, ground_truth, inputs.extra_info)

    def check_rows(self, rows: list[dict]) -> None:
        """UnknownDataSource (naming it and the choices) for the first row whose source has no scorer."""
        for row in rows:
            source = reward_inputs(row).data_source
            if source is not None and not is_known_data_source(source):
                raise UnknownDataSource(unknown_data_source_message(source))


def load_reward_fns(spec: str, task: str | None = "arithmetic") -> list[RewardFunction]:
    """The functions of a comma-separated list of specs, in order, each with its calling convention;
    "auto" falls back to `TASK_REWARDS[task]` for rows without a data_source (`task=None`: no fallback)."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(f"reward spec {spec!r} must be a non-empty string such as 'gsm8k'")
    parts = [part.strip() for part in spec.split(",")]
    if not all(parts):
        raise RewardFunctionError(f"reward spec {spec!r} has an empty entry; separate specs with single commas")
    functions = []
    for part in parts:
        if "://" in part:
            functions.append(ServerReward(part))  # type: ignore[arg-type]  # scored by requests, not calls
        elif part == "auto":
            fallback = BUILTIN_REWARDS[TASK_REWARDS[task]] if task is not None else None
            functions.append(RewardFunction(ScoreByDataSource(fallback), part, "auto"))
        else:
            functions.append(RewardFunction(load_reward_fn(part), part, part.rsplit(":", 1)[-1]))
    return functions


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
    module_name = f"{USER_MODULE_PREFIX}{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
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
