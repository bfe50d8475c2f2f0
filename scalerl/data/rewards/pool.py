"""Reward calls in a pool of worker processes (`data.reward_workers=N`), each call within its time limit.

Each worker is a fresh interpreter (the "spawn" start method) that re-imports the reward functions from
their spec strings ("file.py:fn", "module:fn", "gsm8k", "auto"); no function object is pickled, only a
call's arguments go over the worker's pipe and its value comes back. A worker runs one call at a time,
under the SIGALRM limit of `scalerl.data.rewards.calls.call_with_limit` (the worker's main thread), so a
reward that hangs in Python ends at `timeout_s` and the worker carries on. A call that is not back
`KILL_GRACE_S` later (stuck in C code, or catching the timeout) is given up: its worker is killed and a
new one started. A worker that dies in a call (`os._exit`, a segfault) makes that call a failure
(`RewardCrash`) and is replaced the same way.

Timeouts overlap as in-process (`BatchCalls`): once a call of a batch has timed out, the rest of the batch
shares one deadline, `timeout_s` plus the time the remaining calls take at the pace of earlier calls
spread over the workers, and a batch after one with a timeout starts under such a deadline. Calls left at
the deadline fail as timed out (running ones are killed). Workers are daemonic (so a reward in the pool
cannot start `multiprocessing` children of its own) and end with `close()`, with the interpreter, or
when they see their parent gone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from scalerl.data.rewards.calls import CallOutcome, RewardCrash, RewardExit, RewardTimeout, call_with_limit
from scalerl.data.rewards.functions import RewardFunctionError

START_METHOD = "spawn"  # a clean interpreter: no copy of the trainer's threads, locks or CUDA state
KILL_GRACE_S = 1.0  # how long past its limit a call may take to report its own timeout before it is killed
STARTUP_DEATHS = 3  # workers in a row dying before they are ready: the pool cannot start
STARTUP_LIMIT_S = 300.0  # a worker not ready this long after it started: importing the reward hangs
_PARENT_CHECK_S = 1.0


class RewardPoolError(RewardFunctionError):
    """The workers cannot load the reward functions, or keep dying before they are ready."""


class RaisedInWorker(Exception):
    """A reward call raised in a worker; `repr` is the original exception's, `str` its traceback there."""

    def __init__(self, original_repr: str, worker_traceback: str):
        super().__init__(worker_traceback)
        self.original_repr = original_repr

    def __repr__(self) -> str:
        return self.original_repr


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    task: int | None = None  # index of the call it runs
    sent_at: float = 0.0
    started_at: float = 0.0


class RewardPool:
    """`workers` processes that each load the functions of `specs` (one spec per function, as
    `load_reward_fns(spec, task)` reads it) and run calls of them within `timeout_s`."""

    def __init__(self, specs: Sequence[str], task: str | None, workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least 1 worker, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.specs, self.task, self.size, self.timeout_s = list(specs), task, workers, timeout_s
        self.overlapping = False  # the previous batch had a timeout: start this one under a deadline
        self.seconds_per_call = 0.0  # mean of the calls that returned (an exponential moving average)
        self.replaced = 0  # workers killed or dead and started again, over the pool's life
        self._context = multiprocessing.get_context(START_METHOD)
        self._workers: list[_Worker] = []
        self._startup_deaths = 0
        self._closed = False
        for _ in range(workers):
            self._start_worker()

    def run(self, calls: Sequence[tuple[int, tuple, dict]]) -> list[CallOutcome]:
        """One outcome per `(function index, args, kwargs)`, in order; never raises for what the calls do."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        results: list[CallOutcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        deadline = self._deadline(len(calls)) if self.overlapping else None
        timed_out = False
        while pending or any(w.task is not None for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.task is None and pending:
                    self._send(worker, pending.popleft(), calls)
            idle_since = None if any(w.ready for w in self._workers) else time.monotonic()
            self._wait(deadline)
            now = time.monotonic()
            if idle_since is not None and deadline is not None:
                deadline += now - idle_since  # no worker was up: starting them is not the calls' time
            for worker in list(self._workers):
                error = self._collect(worker, results, now)
                if isinstance(error, RewardTimeout):
                    timed_out = True
            if timed_out and deadline is None:
                deadline = self._deadline(len(pending) + sum(w.task is not None for w in self._workers))
            if deadline is not None and now >= deadline:
                self._give_up(results, pending, deadline)
                timed_out = True
        self.overlapping = timed_out
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every worker (asked first, then killed); the pool cannot run calls afterwards."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(0.5 if worker.task is None else 0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def _deadline(self, remaining: int) -> float:
        return time.monotonic() + self.timeout_s + remaining * self.seconds_per_call / self.size

    def _send(self, worker: _Worker, index: int, calls: Sequence[tuple[int, tuple, dict]]) -> None:
        worker.task, worker.sent_at = index, time.monotonic()
        function_index, args, kwargs = calls[index]
        try:
            worker.conn.send((function_index, args, kwargs))
        except (OSError, EOFError):  # the worker died since it was last seen: `_collect` finds it gone
            pass

    def _wait(self, deadline: float | None) -> None:
        """Until a worker reports or dies, the first running call passes its kill limit, or the deadline."""
        limits = [w.sent_at + self.timeout_s + KILL_GRACE_S if w.task is not None else w.started_at + STARTUP_LIMIT_S
                  for w in self._workers if w.task is not None or not w.ready]
        if deadline is not None:
            limits.append(deadline)
        timeout = max(0.0, min(limits) - time.monotonic()) if limits else None
        handles = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        wait(handles, timeout)

    def _collect(self, worker: _Worker, results: list[CallOutcome | None], now: float) -> BaseException | None:
        """Take `worker`'s message or death into `results`; the error of a call that ended, if any."""
        error: BaseException | None = None
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
            worker.process.join(1.0)  # the pipe closed: the process is ending
        if message is not None:
            kind, payload = message
            if kind == "ready":
                worker.ready, self._startup_deaths = True, 0
            elif kind == "failed":
                self.close()
                raise RewardPoolError(f"reward workers cannot load the reward: {payload}")
            elif worker.task is not None:
                outcome = _outcome_of(kind, payload)
                if outcome.error is None:
                    self._returned_after(now - worker.sent_at)
                results[worker.task], worker.task, error = outcome, None, outcome.error
            return error
        if not worker.ready and now > worker.started_at + STARTUP_LIMIT_S:
            self.close()
            raise RewardPoolError(f"a reward worker was not ready {STARTUP_LIMIT_S:g} s after it started (importing "
                                  f"{', '.join(self.specs)} hangs?)")
        if not worker.process.is_alive():
            code = worker.process.exitcode
            if worker.task is not None:
                error = RewardCrash(f"the reward worker process ended ({_exit_description(code)}) during the call")
                results[worker.task] = CallOutcome(error=error)
            elif not worker.ready:
                self._startup_deaths += 1
                if self._startup_deaths >= STARTUP_DEATHS:
                    self.close()
                    raise RewardPoolError(
                        f"{STARTUP_DEATHS} reward workers in a row ended before they were ready (the last: "
                        f"{_exit_description(code)}; its error is printed above; a script that starts the pool when "
                        "it is imported needs `if __name__ == '__main__':`, as every spawned process imports it)")
            self._replace(worker)
        elif worker.task is not None and now >= worker.sent_at + self.timeout_s + KILL_GRACE_S:
            error = RewardTimeout(f"did not return within data.reward_timeout_s={self.timeout_s:g} s (its worker "
                                  "process was killed and replaced)")
            results[worker.task] = CallOutcome(error=error)
            self._replace(worker)
        return error

    def _give_up(self, results: list[CallOutcome | None], pending: deque, deadline: float) -> None:
        """The batch's deadline passed: every call still running or waiting fails as timed out."""
        why = (f"within the batch's deadline (data.reward_timeout_s={self.timeout_s:g} s after an earlier call timed "
               "out, plus the time the batch's calls take)")
        for worker in list(self._workers):
            if worker.task is not None:
                results[worker.task] = CallOutcome(error=RewardTimeout(f"did not return {why}"))
                self._replace(worker)
        while pending:
            results[pending.popleft()] = CallOutcome(error=RewardTimeout(f"had not started {why}"))

    def _returned_after(self, seconds: float) -> None:
        self.seconds_per_call = seconds if not self.seconds_per_call else 0.9 * self.seconds_per_call + 0.1 * seconds

    def _start_worker(self) -> None:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(target=serve_calls, args=(child_conn, self.specs, self.task, self.timeout_s,
                                                                  os.getpid()),
                                        name="scalerl-reward-worker", daemon=True)
        process.start()
        child_conn.close()
        self._workers.append(_Worker(process, parent_conn, started_at=time.monotonic()))

    def _replace(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(1.0)
        worker.conn.close()
        self._workers.remove(worker)
        self.replaced += 1
        self._start_worker()


def serve_calls(conn: Connection, specs: list[str], task: str | None, timeout_s: float, parent_pid: int) -> None:
    """A worker's life: load the functions, say "ready", then run each `(index, args, kwargs)` received
    and send back `(kind, payload)`, until told to stop (None), the pipe closes or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="scalerl-reward-parent", daemon=True).start()
    from scalerl.data.rewards.specs import load_reward_fns  # here: the pool's parent never needs it

    try:
        functions = [function for spec in specs for function in load_reward_fns(spec, task)]
    except BaseException as error:  # a SystemExit in the module included: the parent must hear why
        conn.send(("failed", f"{error}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, args, kwargs = message
        try:
            reply: tuple[str, Any] = ("value", call_with_limit(functions[index].fn, args, kwargs, timeout_s))
        except (RewardTimeout, RewardExit) as error:
            reply = (type(error).__name__, str(error))
        except Exception as error:
            reply = ("raised", (repr(error), traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception as error:  # the value cannot be pickled back
            conn.send(("raised", (f"returned a value that cannot be sent back from the worker ({error!r})", "")))


def _outcome_of(kind: str, payload: Any) -> CallOutcome:
    if kind == "value":
        return CallOutcome(payload)
    if kind == "RewardTimeout":
        return CallOutcome(error=RewardTimeout(payload))
    if kind == "RewardExit":
        return CallOutcome(error=RewardExit(payload))
    return CallOutcome(error=RaisedInWorker(*payload))


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_CHECK_S)
    os._exit(0)
