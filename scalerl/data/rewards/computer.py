"""Scoring a batch of responses: one reward function or several with weights, failure-safe, with the extra
metrics verl-style functions return, and a stop once the reward keeps failing.

A reward is named by a spec (`scalerl.data.rewards.specs`: "gsm8k", "math", "auto", "module:function",
"file.py:function", or several of them comma-separated) or given as a callable, in any of the accepted
signatures (`scalerl.data.rewards.functions`: scalerl's `fn(response, ground_truth)`, verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)` and its batched form, TRL's
`fn(prompts, completions, **columns)`). `default_compute_score` is verl's scorer by data source.

With `workers` (`data.reward_workers`) the functions run in a pool of processes (`scalerl.data.rewards.pool`);
a spec that is a URL is a reward server (`scalerl.data.rewards.http`: the schema, batching and retries);
`close()` ends the pool. A generative judge with ``data.judge.workers`` runs in a pool of its own
(`scalerl.data.rewards.judge_pool`): `start(responses, rows)` hands it a part's responses as soon as they
are generated, and `compute` with the same arguments takes its verdicts.

`RewardComputer.compute(responses, rows)` returns `(rewards, num_failures)`. A call that raises, calls
`sys.exit`, runs longer than its limit (`data.reward_timeout_s`; `scalerl.data.rewards.calls` overlaps the
timeouts of a batch), ends its worker process, fails as a server request, or returns something that is not a finite number, scores 0.0 and is counted
(`reward/num_failures` in the trainer's metrics) and logged once per kind of failure, so one bad sample
never stops or hangs a run; `max_consecutive_failures` samples failing in a row (`data.max_reward_failures`)
stop it with `RewardFailureLimit`, naming the function, and so does, at once, a batch whose every sample
timed out before any sample has scored (a reward that hangs on every call would otherwise cost a timeout
per batch until the limit). Several functions add up as TRL adds them: the weighted sum of the scores that
are not None (a failed term counts 0 and the sample as one failure).
After each call `last_metrics` holds `reward/extra/<name>` means: the numbers beside "score" in returned
dicts and, with several functions, each function's mean (Nones left out, as TRL's `rewards/<name>/mean`).
A reward model (`scalerl.data.rewards.model`, `data.reward_model.path`) adds `model_weight` x its score to each
sample's (`data.reward=none`: its score alone), logged as `reward/extra/reward_model`; it never fails quietly.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from scalerl.core.errors import RunFailure
from scalerl.data.answers import (
    extract_boxed,
    extract_hash_answer,
    normalize_math_answer,
)
from scalerl.data.errors import DataError
from scalerl.data.rewards.calls import (
    BatchCalls,
    CallFailure,
    CallOutcome,
    RewardTimeout,
    call_with_limit,
)
from scalerl.data.rewards.functions import (
    RewardFunction,
    RewardFunctionError,
    Score,
    read_score,
    reward_inputs,
)
from scalerl.data.rewards.http import ServerCalls
from scalerl.data.rewards.model import RewardModel, reward_model_from_config
from scalerl.data.rewards.pool import RewardPool
from scalerl.data.rewards.specs import (
    BUILTIN_REWARDS,
    TASK_REWARDS,
    USER_MODULE_PREFIX,
    RewardFn,
    gsm8k_reward,
    load_reward_fn,
    load_reward_fns,
    math_reward,
)
from scalerl.data.rewards.verl_scorers import default_compute_score

logger = logging.getLogger(__name__)
EXTRA_METRIC_PREFIX = "reward/extra/"
MODEL_SCORE_METRIC = EXTRA_METRIC_PREFIX + "reward_model"


class RewardFailureLimit(RunFailure):
    """The reward failed on `data.max_reward_failures` samples in a row, or timed out on a whole batch before
    any sample scored; the message names the function, the last failure and (where the trainer says) the last
    good checkpoint."""


class RewardComputer:
    """Scores a batch of responses with one or several reward functions, never letting a failing sample
    crash or hang the run (see the module's docstring).

    `reward_fn` is a spec, a callable, or a list of them; `weights` one number per function (default 1);
    `task` the data task whose built-in "auto" uses for rows without a data_source. The trainer may set
    `last_good_checkpoint` to a function describing it, for the message of `RewardFailureLimit`.
    """

    def __init__(self, reward_fn: RewardFn | str | Sequence[RewardFn | str], timeout_s: float = 30.0, *,
                 weights: Sequence[float] | None = None, max_consecutive_failures: int = 0,
                 task: str | None = "arithmetic", workers: int = 0, server_batch_size: int = 64,
                 server_retries: int = 2, model: RewardModel | None = None, model_weight: float = 1.0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.model, self.model_weight = model, float(model_weight)  # `scalerl.data.rewards.model`: its score is added
        if reward_fn == "none" and model is None:
            raise RewardFunctionError("data.reward=none needs data.reward_model.path (a reward model to score with)")
        self.functions = [] if reward_fn == "none" else _unique_names(_functions_of(reward_fn, task))
        self.weights = [1.0] * len(self.functions) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.functions):
            raise RewardFunctionError(f"data.reward_weights has {len(self.weights)} weights for "
                                      f"{len(self.functions)} reward functions; give one per function")
        if max_consecutive_failures < 0:
            raise ValueError(f"max_consecutive_failures must be >= 0, got {max_consecutive_failures}")
        self.max_consecutive_failures = max_consecutive_failures
        self.reward_fn = self.functions[0].fn if self.functions else None
        self.name = " + ".join([getattr(f.fn, "__qualname__", f.name) for f in self.functions]
                               + ([f"reward model {model.path}"] if model is not None else []))
        self.passes_row = self.functions[0].passes_row if self.functions else False
        self.total_failures = self.consecutive_failures = 0
        self.samples_seen = self.samples_scored = 0  # over this computer's life
        self.last_metrics: dict[str, float] = {}
        self.last_good_checkpoint: Callable[[], str] | None = None
        self._calls = [BatchCalls(timeout_s) for _ in self.functions]
        # `workers` > 0: the functions run in a pool of processes (`reward_pool`), reward servers get that
        # many requests in flight (`reward_http`); the pool lives until `close()`.
        self._servers = {i: ServerCalls(f.url, timeout_s, server_retries, server_batch_size, max(1, workers))
                         for i, f in enumerate(self.functions) if f.style == "http"}
        pooled = [i for i in range(len(self.functions)) if i not in self._servers  # a judge has its own process(es)
                  and not getattr(self.functions[i].fn, "keeps_own_process", False)] if workers else []
        self._pool_index = {i: position for position, i in enumerate(pooled)}
        self.pool = RewardPool([_pool_spec(self.functions[i]) for i in pooled], task, workers, timeout_s) \
            if pooled else None
        self._logged_failure_kinds: set[str] = set()
        self._last_failure = ""

    def compute(self, responses: Sequence[str], rows: Sequence[dict],
                completion_ids: Sequence[Sequence[int]] | None = None) -> tuple[list[float], int]:
        """One reward per response; `rows[i]` is the data row `responses[i]` answers (with "ground_truth" for
        scalerl-style functions); `completion_ids`, where given, reach TRL functions that ask for them."""
        if len(responses) != len(rows):
            raise ValueError(f"got {len(responses)} responses but {len(rows)} rows; pass one row per response")
        per_function = self.sample_scores(responses, rows, completion_ids)
        model_scores = self.model.score([reward_inputs(row).prompt for row in rows], responses) if self.model else None
        rewards, failures, timeouts = [], 0, 0
        for index, response in enumerate(responses):
            scores = [column[index] for column in per_function]
            if any(score.problem for score in scores):
                failures += 1
                self.consecutive_failures += 1
                timeouts += any(score.kind == RewardTimeout.__name__ for score in scores)
            else:
                self.consecutive_failures = 0
                self.samples_scored += 1
                if scores and all(s.value is None for s in scores) and "all None" not in self._logged_failure_kinds:
                    self._logged_failure_kinds.add("all None")
                    logger.warning("every reward function returned None (not applicable) for response %r; it scores "
                                   "0.0 (further such samples are not logged)", response[:120])
            rewards.append(sum(w * s.value for w, s in zip(self.weights, scores) if s.value is not None) + 0.0
                           + (self.model_weight * model_scores[index] if model_scores is not None else 0.0))
        self.total_failures += failures
        self.last_metrics = self._extra_metrics(per_function)
        if model_scores:  # the model's own score, before data.reward_model.weight
            self.last_metrics[MODEL_SCORE_METRIC] = sum(model_scores) / len(model_scores)
        self.samples_seen += len(responses)
        if self.max_consecutive_failures and self.consecutive_failures >= self.max_consecutive_failures:
            raise RewardFailureLimit(self._failure_limit_message())
        if self.max_consecutive_failures and not self.samples_scored and responses and timeouts == len(responses):
            # A reward that hangs on every call would cost a timeout per batch until the limit: minutes.
            raise RewardFailureLimit(self._never_returned_message(timeouts))
        return rewards, failures

    @property
    def overlaps(self) -> bool:
        """Whether a function starts work ahead of `compute` (`start`): a judge in its own pool of workers."""
        return any(hasattr(f.fn, "prefetch") for f in self.functions)

    def start(self, responses: Sequence[str], rows: Sequence[dict],
              completion_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Start scoring ``responses`` where a function can work ahead (`overlaps`: the judge pool of
        `scalerl.data.rewards.judge_pool` judges them while the trainer generates more); `compute` with the
        same arguments later takes the scores. A function that cannot start fails there, counted, not here."""
        for f in self.functions:
            prefetch = getattr(f.fn, "prefetch", None)
            if prefetch is None or f.per_sample:
                continue
            try:
                args, kwargs = f.batch_call(responses, rows, completion_ids)
                prefetch(*args, **kwargs)
            except Exception:  # the same call in `compute` meets it again and counts it
                logger.debug("reward %s could not start ahead", f.name, exc_info=True)

    def sample_scores(self, responses: Sequence[str], rows: Sequence[dict],
                      completion_ids: Sequence[Sequence[int]] | None = None) -> list[list[Score]]:
        """Each function's `Score` of each sample (what `compute` adds up), failures logged, not counted."""
        self._check_rows(rows)
        return [self._scores(index, f, responses, rows, completion_ids) for index, f in enumerate(self.functions)]

    def check_split(self, rows: Sequence[dict], split: str) -> None:
        """Before the first call: every function gets what it needs from ``rows`` (a split's first rows; the
        keys of a data set's rows agree), else an error naming the split, the missing inputs and the columns
        the rows do give."""
        for f in self.functions:
            if not isinstance(f, RewardFunction):  # a reward server takes whole rows
                continue
            for row in rows:
                missing = f.missing_inputs(row)
                if missing:
                    columns = sorted(reward_inputs(row).columns)
                    raise RewardFunctionError(
                        f"reward {f.name} needs {', '.join(map(repr, missing))}, which the {split} do not give "
                        f"(their columns: {columns or 'none'}); add the column to those rows, or choose a reward "
                        "that reads what they have (data.reward)")

    def close(self) -> None:
        """Stop the worker processes, if any (the run's end); in-process scoring needs no closing."""
        if self.pool is not None:
            self.pool.close()
        for f in self.functions:  # a judge's own pool of workers
            if hasattr(f.fn, "prefetch"):
                getattr(f.fn, "close", lambda: None)()

    def _check_rows(self, rows: Sequence[dict]) -> None:
        for f in self.functions:
            if f.style == "scalerl":
                for index, row in enumerate(rows):
                    if not reward_inputs(row).has_ground_truth:
                        raise DataError(f"row {index} given to reward {f.name} has no 'ground_truth' "
                                        f"(keys: {sorted(row)})")
            check_rows = getattr(f.fn, "check_rows", None)
            if check_rows is not None:
                check_rows(rows)

    def _scores(self, index: int, f: RewardFunction, responses: Sequence[str], rows: Sequence[dict],
                completion_ids: Sequence[Sequence[int]] | None) -> list[Score]:
        """`f`'s score of each sample; a failure is a Score with a `problem`, logged once per kind."""
        if f.per_sample:
            calls = [f.sample_call(r, row) for r, row in zip(responses, rows)]
            if index in self._pool_index:
                outcomes = self.pool.run([(self._pool_index[index], args, kwargs) for args, kwargs in calls])
            else:
                outcomes = self._calls[index].run(f.fn, calls)
            return [self._score_of(f, o.value, o.error, r) for o, r in zip(outcomes, responses)]
        scores: list[Score] = []
        for start, stop, outcome in self._batch_outcomes(index, f, responses, rows, completion_ids):
            scores += self._batch_scores(f, outcome, responses[start:stop])
        return scores

    def _batch_outcomes(self, index: int, f: RewardFunction, responses: Sequence[str], rows: Sequence[dict],
                        completion_ids: Sequence[Sequence[int]] | None) -> list[tuple[int, int, CallOutcome]]:
        """`(start, stop, outcome)` of each call a batched function's batch is scored in: the whole batch in
        this process, one part per worker in a pool, requests of `data.reward_batch_size` for a server."""
        if index in self._servers:
            return self._servers[index].run(f, responses, rows)
        if index in self._pool_index:
            size = -(-len(responses) // self.pool.size) if responses else 1
            bounds = [(start, min(start + size, len(responses))) for start in range(0, len(responses), size)]
            calls = [(self._pool_index[index], *f.batch_call(responses[a:b], rows[a:b],
                                                             completion_ids[a:b] if completion_ids else None))
                     for a, b in bounds]
            return [(a, b, outcome) for (a, b), outcome in zip(bounds, self.pool.run(calls))]
        args, kwargs = f.batch_call(responses, rows, completion_ids)
        try:
            return [(0, len(responses), CallOutcome(call_with_limit(f.fn, args, kwargs, self.timeout_s)))]
        except (RewardTimeout, Exception) as error:
            return [(0, len(responses), CallOutcome(error=error))]

    def _batch_scores(self, f: RewardFunction, outcome: CallOutcome, responses: Sequence[str]) -> list[Score]:
        """The scores of one batched call's samples: each value read, or the call's failure for them all."""
        if outcome.error is not None:
            return [self._score_of(f, None, outcome.error, responses[0] if responses else "")] * len(responses)
        values = outcome.value
        if not isinstance(values, (list, tuple)) and hasattr(values, "tolist"):
            values = values.tolist()  # a NumPy array or a tensor
        if not isinstance(values, (list, tuple)) or len(values) != len(responses):
            count = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            what = f"returned {count} for {len(responses)} samples; a batched reward returns one value per sample"
            self._log_failure(f"{f.name}: wrong count", what, responses[0] if responses else "", name=f.name)
            return [Score(problem=what, kind="wrong count")] * len(responses)
        return [self._score_of(f, None, v, r) if isinstance(v, CallFailure) else self._score_of(f, v, None, r)
                for v, r in zip(values, responses)]

    def _score_of(self, f: RewardFunction, value: Any, error: BaseException | None, response: str) -> Score:
        if isinstance(error, (RewardTimeout, CallFailure)):  # no traceback: the message says it all
            score = Score(problem=str(error), kind=type(error).__name__)
        elif error is not None:  # any user bug: score 0, count, carry on
            score = Score(problem=f"raised {error!r}", kind=type(error).__name__)
            self._log_failure(f"{f.name}: {score.kind}", score.problem, response, error, f.name)
            return score
        else:
            score = read_score(value, none_means_not_applicable=f.style == "trl")
        if score.problem:
            self._log_failure(f"{f.name}: {score.kind}", score.problem, response, name=f.name)
        return score

    def _extra_metrics(self, per_function: list[list[Score]]) -> dict[str, float]:
        several = len(self.functions) > 1
        metrics: dict[str, float] = {}
        for f, scores in zip(self.functions, per_function):
            prefix = EXTRA_METRIC_PREFIX + (f"{f.name}/" if several else "")
            values = [s.value for s in scores if s.value is not None]
            if several and values:
                metrics[EXTRA_METRIC_PREFIX + f.name] = sum(values) / len(values)
            extras: dict[str, list[float]] = defaultdict(list)
            for score in scores:
                for key, number in score.extras.items():
                    extras[key].append(number)
            metrics.update({prefix + key: sum(numbers) / len(numbers) for key, numbers in sorted(extras.items())})
        return metrics

    def _log_failure(self, kind: str, what: str, response: str, exc_info: BaseException | None = None,
                     name: str | None = None) -> None:
        self._last_failure = f"{name or self.name} {what}"
        if kind in self._logged_failure_kinds:
            return
        self._logged_failure_kinds.add(kind)
        logger.warning(
            "reward function %s %s for response %r; scoring it 0.0 (counted in reward/num_failures, "
            "further %s failures are not logged)",
            name or self.name, what, response[:120], kind, exc_info=exc_info,
        )

    def _failure_limit_message(self) -> str:
        where = f" Last good checkpoint: {self.last_good_checkpoint()}" if self.last_good_checkpoint else ""
        named = " + ".join(repr(f.spec) if f.spec else f.name for f in self.functions)
        return (f"reward {named} failed on the last {self.consecutive_failures} samples in a row "
                f"(data.max_reward_failures={self.max_consecutive_failures}), the last one because {self._last_failure}; "
                "the run stops rather than train on zero rewards. Fix the reward function, or raise "
                f"data.max_reward_failures (0 = never stop).{where}")

    def _never_returned_message(self, timeouts: int) -> str:
        where = f" Last good checkpoint: {self.last_good_checkpoint()}" if self.last_good_checkpoint else ""
        named = " + ".join(repr(f.spec) if f.spec else f.name for f in self.functions)
        return (f"reward {named} timed out on all {timeouts} samples of the batch and has scored none of the run's "
                f"{self.samples_seen} samples so far; the last one: {self._last_failure}. The run stops now rather "
                f"than wait out data.max_reward_failures={self.max_consecutive_failures}: fix the reward function so "
                f"that it returns within data.reward_timeout_s={self.timeout_s:g} s, or raise data.reward_timeout_s "
                f"if it is only slow.{where}")


def reward_from_config(data_cfg: Any, device: Any = "cpu") -> RewardComputer:
    """The reward a run's `data` config section asks for (its reward model, if any, on `device`)."""
    section = getattr(data_cfg, "reward_model", None)  # absent from sections built by hand without one
    model = reward_model_from_config(section, getattr(data_cfg, "chat_template", False), device) if section else None
    reward: Any = data_cfg.reward
    specs = [spec.strip() for spec in reward.split(",")]
    if "judge" in specs:  # a generative judge (data.judge): a model, built here, among the other functions
        if getattr(data_cfg.judge, "workers", 0):  # its own worker processes, judging while generation goes on
            from scalerl.data.rewards.judge_pool import pooled_judge_from_config

            judge: Any = pooled_judge_from_config(data_cfg, device)
        else:
            from scalerl.data.rewards.judge import judge_from_config

            judge = judge_from_config(data_cfg, device)
        reward = [judge if spec == "judge" else spec for spec in specs]
    return RewardComputer(reward, timeout_s=data_cfg.reward_timeout_s,
                          weights=list(data_cfg.reward_weights) or None,
                          max_consecutive_failures=data_cfg.max_reward_failures, task=data_cfg.task,
                          # a section without the keys (written before they came) scores as it did
                          workers=getattr(data_cfg, "reward_workers", 0),
                          server_batch_size=getattr(data_cfg, "reward_batch_size", 64),
                          server_retries=getattr(data_cfg, "reward_retries", 2),
                          model=model, model_weight=section.weight if model else 1.0)


def _pool_spec(f: RewardFunction) -> str:
    """The spec a pool worker imports `f` from: its own, or `module:name` of a module-level function."""
    if f.spec:
        return f.spec
    module, name = getattr(f.fn, "__module__", None), getattr(f.fn, "__qualname__", "")
    path = getattr(sys.modules.get(module or ""), "__file__", None)
    if module and module.startswith(USER_MODULE_PREFIX) and path and name.isidentifier():
        return f"{path}:{name}"  # loaded from a file: the worker loads the same file
    if not module or module == "__main__" or not name.isidentifier():
        raise RewardFunctionError(
            f"reward {f.name} cannot run in data.reward_workers processes: a worker imports it by name, so give a "
            "spec ('file.py:function' or 'module:function') or a function defined at the top of an importable module")
    return f"{module}:{name}"


def _functions_of(reward_fn: Any, task: str | None) -> list[RewardFunction]:
    if isinstance(reward_fn, str):
        return load_reward_fns(reward_fn, task)
    if isinstance(reward_fn, (list, tuple)):
        if not reward_fn:
            raise RewardFunctionError("no reward function given")
        return [f for item in reward_fn for f in _functions_of(item, task)]
    return [RewardFunction(reward_fn)]


def _unique_names(functions: list[RewardFunction]) -> list[RewardFunction]:
    """Two functions with one name (`score` from two files) get `score`, `score_2` in their metrics."""
    seen: dict[str, int] = {}
    for f in functions:
        seen[f.name] = seen.get(f.name, 0) + 1
        if seen[f.name] > 1:
            f.name = f"{f.name}_{seen[f.name]}"
    return functions


__all__ = [
    "BUILTIN_REWARDS", "EXTRA_METRIC_PREFIX", "TASK_REWARDS", "RewardComputer", "RewardFailureLimit", "RewardFn",
    "RewardFunctionError", "default_compute_score", "extract_boxed", "extract_hash_answer", "gsm8k_reward",
    "load_reward_fn", "load_reward_fns", "math_reward", "normalize_math_answer", "reward_from_config",
]
