"""Calls of a user's reward function within time limits: one call, or one call per sample of a batch with
overlapping timeouts; a `sys.exit` in a call is caught as a failure.

The code runs in this process. One call in the main thread (the trainer's, also a Ray actor's) is limited
by a SIGALRM timer: its handler raises in the reward's own Python code, sleeps included, and the call is
really stopped. Elsewhere (signals reach only the main thread) the call runs in a daemon thread, given up
at its limit and then stopped by an asynchronous `RewardTimeout` raised in that thread: Python code ends at
once; a C call (a `time.sleep`, a socket read, a regular expression backtracking for ever) only when it
returns to Python, and until then the thread is left running in the background.

A batch (`BatchCalls`) is called one sample after another, each within `timeout_s`, until a call times out.
From there on the reward is taken to hang: the rest of the batch is started at once on up to
`OVERLAP_THREADS` threads sharing one deadline, `timeout_s` plus the time the remaining calls took at the
pace of earlier calls that returned. So a reward that never returns costs about two timeouts for the
first batch and one for each later batch, however many samples there are, instead of samples x timeout;
a batch with no timeout sends the next one back to one-at-a-time calls. (So a reward's calls may run
concurrently, in threads, once one has timed out.)
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

OVERLAP_THREADS = 64  # most calls of one batch running at once after a timeout


class RewardTimeout(BaseException):
    """The reward call did not return within its limit. A BaseException, so that a reward which catches
    `Exception` in a retry loop cannot swallow it and run on."""


class CallFailure(Exception):
    """A call that gave no value for a reason its message says in full (no traceback worth logging)."""


class RewardExit(CallFailure):
    """The reward function called `sys.exit` (or raised SystemExit) instead of returning a score."""


class RewardCrash(CallFailure):
    """The process running the reward call (a pool worker) ended before the call returned."""


@dataclass
class CallOutcome:
    """What one call gave: its value, or the exception it ended with (a RewardTimeout when it hung)."""

    value: Any = None
    error: BaseException | None = None


def call_with_limit(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float) -> Any:
    """`fn(*args, **kwargs)`; RewardTimeout after `timeout_s`, RewardExit for a SystemExit inside it."""
    if threading.current_thread() is threading.main_thread():
        return _call_with_alarm(fn, args, kwargs, timeout_s)
    return _call_in_thread(fn, args, kwargs, timeout_s)


class BatchCalls:
    """Calls one function once per sample of a batch, each within `timeout_s`, with timeouts overlapping
    once one has happened (see the module's docstring). Keeps, between batches, whether the last batch
    timed out and the mean time of the calls that returned."""

    def __init__(self, timeout_s: float, threads: int = OVERLAP_THREADS):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.threads = timeout_s, threads
        self.overlapping = False  # the previous batch had a timeout: start this one overlapped
        self.seconds_per_call = 0.0  # mean of the calls that returned (an exponential moving average)

    def run(self, fn: Callable[..., Any], calls: Sequence[tuple[tuple, dict]]) -> list[CallOutcome]:
        """One outcome per `(args, kwargs)` in `calls`, in order; never raises for what the calls do."""
        outcomes: list[CallOutcome] = []
        timed_out = False
        while len(outcomes) < len(calls) and not (self.overlapping or timed_out):
            args, kwargs = calls[len(outcomes)]
            started = time.monotonic()
            try:
                outcomes.append(CallOutcome(call_with_limit(fn, args, kwargs, self.timeout_s)))
                self._returned_after(time.monotonic() - started)
            except RewardTimeout as error:
                outcomes.append(CallOutcome(error=error))
                timed_out = True
            except Exception as error:  # the reward's own bug: an outcome like any other
                outcomes.append(CallOutcome(error=error))
        if len(outcomes) < len(calls):
            rest = self._overlapped(fn, calls[len(outcomes):])
            timed_out = timed_out or any(isinstance(o.error, RewardTimeout) for o in rest)
            outcomes += rest
        self.overlapping = timed_out
        return outcomes

    def _returned_after(self, seconds: float) -> None:
        self.seconds_per_call = seconds if not self.seconds_per_call else 0.9 * self.seconds_per_call + 0.1 * seconds

    def _overlapped(self, fn: Callable[..., Any], calls: Sequence[tuple[tuple, dict]]) -> list[CallOutcome]:
        deadline_s = self.timeout_s + len(calls) * self.seconds_per_call
        results: list[CallOutcome | None] = [None] * len(calls)
        state = _SharedCalls(len(calls))

        def work() -> None:
            try:
                state.go.wait()
                while True:
                    with state.lock:
                        if state.stopped or state.next_index >= len(calls):
                            return
                        index, state.next_index = state.next_index, state.next_index + 1
                        state.running[threading.get_ident()] = index
                    args, kwargs = calls[index]
                    try:
                        outcome = CallOutcome(_call_guarded(fn, args, kwargs))
                    except BaseException as error:  # the stopping RewardTimeout included
                        outcome = CallOutcome(error=error)
                    with state.lock:
                        state.running.pop(threading.get_ident(), None)
                        if results[index] is None:
                            results[index] = outcome
                            state.finished += 1
                            if state.finished == len(calls):
                                state.all_finished.set()
            except BaseException:  # a stopping RewardTimeout that landed after the call: its slot is filled
                pass

        # All threads start before any call runs: starting one costs a hand-over of the interpreter lock,
        # which calls spinning in Python would make slow for every later thread.
        for _ in range(min(self.threads, len(calls))):
            threading.Thread(target=work, name="scalerl-reward-call", daemon=True).start()
        state.go.set()
        state.all_finished.wait(deadline_s)
        with state.lock:
            state.stopped = True
            for index, result in enumerate(results):
                if result is None:
                    started = index in state.running.values()
                    results[index] = CallOutcome(error=RewardTimeout(
                        f"{'did not return' if started else 'had not started'} within the batch's deadline of "
                        f"{deadline_s:.3g} s (data.reward_timeout_s={self.timeout_s:g} s after an earlier call "
                        "timed out, plus the time the batch's calls take)"))
            for thread_id in state.running:
                _stop_thread(thread_id)
        return results  # type: ignore[return-value]


class _SharedCalls:
    """The bookkeeping the threads of one overlapped batch share, under `lock`."""

    def __init__(self, count: int):
        self.lock = threading.Lock()
        self.go, self.all_finished = threading.Event(), threading.Event()
        self.next_index = self.finished = 0
        self.stopped = count == 0
        self.running: dict[int, int] = {}  # thread id -> index of the call it runs


def _call_guarded(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:  # a reward that exits would end the whole run without a word
        raise RewardExit(f"called sys.exit({e.code!r})") from None


def _stop_thread(thread_id: int) -> None:
    """Raise RewardTimeout in the thread `thread_id` at its next Python instruction."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(RewardTimeout))


def _call_with_alarm(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float) -> Any:
    def on_alarm(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"did not return within data.reward_timeout_s={timeout_s:g} s")

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)  # keep another user's timer going
    started = time.monotonic()
    try:
        return _call_guarded(fn, args, kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, previous_delay - (time.monotonic() - started)))


def _call_in_thread(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float) -> Any:
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            try:
                value = _call_guarded(fn, args, kwargs)
                with lock:
                    outcome.setdefault("value", value)
            except BaseException as e:  # handed to the caller's thread below
                with lock:
                    outcome.setdefault("error", e)
        except BaseException:  # the stopping RewardTimeout, landed after the call ended
            pass

    worker = threading.Thread(target=run, name="scalerl-reward-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    with lock:
        if not outcome:
            outcome["error"] = RewardTimeout(
                f"did not return within data.reward_timeout_s={timeout_s:g} s (stopped when it next runs Python)")
            _stop_thread(worker.ident)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
