"""A reward call within its limit: hangs, sleeps, retry loops that swallow exceptions and `sys.exit` all end
as counted failures (score 0), in the main thread (SIGALRM) and in other threads (abandoned daemon thread)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import pytest

from scalerl.data.reward_calls import RewardExit, RewardTimeout, call_with_limit
from scalerl.data.rewards import RewardComputer

ROWS = [{"ground_truth": "1"}]


def sleeps(response, truth):
    time.sleep(60)


def spins(response, truth):
    while True:
        pass


def swallows(response, truth):
    while True:  # a retry loop that catches everything it knows of
        try:
            time.sleep(60)
        except Exception:
            pass


def exits(response, truth):
    sys.exit(3)


@pytest.mark.parametrize("reward", [sleeps, spins, swallows], ids=lambda f: f.__name__)
def test_hung_reward_scores_zero_within_the_limit(reward, caplog):
    computer = RewardComputer(reward, timeout_s=0.3)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards"):
        assert computer.compute(["a", "b"], ROWS * 2) == ([0.0, 0.0], 2)
    assert time.monotonic() - start < 3.0
    (message,) = [r.getMessage() for r in caplog.records]  # logged once for both samples
    assert "data.reward_timeout_s=0.3" in message and "reward/num_failures" in message


def test_sys_exit_in_a_reward_is_a_failure_with_a_message(caplog):
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards"):
        assert RewardComputer(exits).compute(["a"], ROWS) == ([0.0], 1)
    assert "called sys.exit(3)" in caplog.records[0].getMessage()


def test_the_alarm_is_restored_after_each_call():
    previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    try:
        assert call_with_limit(lambda a, b: a + b, (1, 2), {}, 5.0) == 3
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_outside_the_main_thread_the_call_is_abandoned_not_waited_for():
    outcome = {}

    def score_in_thread():
        start = time.monotonic()
        outcome["scores"] = RewardComputer(sleeps, timeout_s=0.3).compute(["a"], ROWS)
        outcome["seconds"] = time.monotonic() - start
        for fn in (exits, lambda a, b: 1 / 0):
            try:
                call_with_limit(fn, ("a", "b"), {}, 1.0)
            except (RewardExit, ZeroDivisionError) as e:
                outcome.setdefault("errors", []).append(type(e).__name__)

    worker = threading.Thread(target=score_in_thread)
    worker.start()
    worker.join(10)
    assert outcome["scores"] == ([0.0], 1) and outcome["seconds"] < 3.0
    assert outcome["errors"] == ["RewardExit", "ZeroDivisionError"]


def test_timeout_is_not_an_exception_a_reward_can_swallow():
    assert not issubclass(RewardTimeout, Exception)
