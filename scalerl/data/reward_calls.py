"""One call of a user's reward function within a time limit, and a `sys.exit` in it caught as a failure.

In the main thread (the trainer's, also a Ray actor's) the limit is a SIGALRM timer: its handler raises in
the reward's own Python code, sleeps included, and the call is really stopped. Elsewhere (signals reach only
the main thread) the call runs in a daemon thread that is abandoned on timeout: the run goes on, the
stray call finishes or not in the background. Code stuck inside one C call (e.g. a regular expression that
backtracks forever) is interrupted only when it returns to Python; the thread form bounds it regardless.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable


class RewardTimeout(BaseException):
    """The reward call did not return within its limit. A BaseException, so that a reward which catches
    `Exception` in a retry loop cannot swallow it and run on."""


class RewardExit(Exception):
    """The reward function called `sys.exit` (or raised SystemExit) instead of returning a score."""


def call_with_limit(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float) -> Any:
    """`fn(*args, **kwargs)`; RewardTimeout after `timeout_s`, RewardExit for a SystemExit inside it."""
    if threading.current_thread() is threading.main_thread():
        return _call_with_alarm(fn, args, kwargs, timeout_s)
    return _call_in_thread(fn, args, kwargs, timeout_s)


def _call_guarded(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:  # a reward that exits would end the whole run without a word
        raise RewardExit(f"called sys.exit({e.code!r})") from None


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

    def run() -> None:
        try:
            outcome["value"] = _call_guarded(fn, args, kwargs)
        except BaseException as e:  # handed to the caller's thread below
            outcome["error"] = e

    worker = threading.Thread(target=run, name="scalerl-reward-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout(f"did not return within data.reward_timeout_s={timeout_s:g} s (left running)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
