"""A reward call within its limit: hangs, sleeps, retry loops that swallow exceptions and `sys.exit` all end
as counted failures (score 0), in the main thread (SIGALRM) and in other threads (abandoned daemon thread)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import pytest

from scalerl.data.rewards.calls import RewardExit, RewardTimeout, call_with_limit
from scalerl.data.rewards.computer import RewardComputer, RewardFailureLimit

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
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
        assert computer.compute(["a", "b"], ROWS * 2) == ([0.0, 0.0], 2)
    assert time.monotonic() - start < 3.0
    (message,) = [r.getMessage() for r in caplog.records]  # logged once for both samples
    assert "data.reward_timeout_s=0.3" in message and "reward/num_failures" in message


def test_sys_exit_in_a_reward_is_a_failure_with_a_message(caplog):
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
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


def hangs_on_some(response, truth):
    if response == "hang":
        time.sleep(60)
    time.sleep(0.005)
    return 1.0


def _reward_threads(other_than: set = frozenset()) -> int:
    return sum(t.name == "scalerl-reward-call" and t.is_alive() and t not in other_than for t in threading.enumerate())


def test_a_reward_hanging_on_every_call_ends_a_batch_of_64_within_about_one_timeout():
    """The first timeout turns the rest of the batch into overlapping calls under one deadline (not 64 x 0.5 s
    = 32 s); the next batch starts overlapped; the hung threads are stopped, not left spinning."""
    sleeping_from_other_tests = set(threading.enumerate())
    computer = RewardComputer(spins, timeout_s=0.5)
    # Bounds with room for a loaded machine (measured quiet: about 1.0 s, then 0.5 s), still far below the
    # 32 s that calls one after another would take.
    for batch, most_seconds in ((1, 8 * 0.5), (2, 6 * 0.5)):
        start = time.monotonic()
        assert computer.compute(["a"] * 64, ROWS * 64) == ([0.0] * 64, 64)
        assert time.monotonic() - start < most_seconds, batch
    deadline = time.monotonic() + 5
    while _reward_threads(sleeping_from_other_tests) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _reward_threads(sleeping_from_other_tests) == 0  # each spinning call got a RewardTimeout at its next instruction


def test_calls_that_return_are_scored_while_others_hang():
    computer = RewardComputer(hangs_on_some, timeout_s=0.5)
    responses = ["ok"] * 10 + ["hang"] + ["ok"] * 20 + ["hang"] + ["ok"] * 10
    start = time.monotonic()
    scores, failures = computer.compute(responses, ROWS * len(responses))
    assert time.monotonic() - start < 2.5 * 0.5 + 0.5
    assert failures == 2 and [i for i, s in enumerate(scores) if s == 0.0] == [10, 31]
    assert computer.compute(["ok"] * 3, ROWS * 3) == ([1.0] * 3, 0)  # an overlapped batch without timeouts...
    assert not computer._calls[0].overlapping  # ...sends the next one back to one call at a time


def test_a_hanging_batched_reward_is_one_call_within_the_limit():
    def trl_hangs(prompts, completions, **columns):
        time.sleep(60)

    start = time.monotonic()
    assert RewardComputer(trl_hangs, timeout_s=0.3).compute(["a"] * 8, [{"prompt": "p"}] * 8) == ([0.0] * 8, 8)
    assert time.monotonic() - start < 2.0


def test_consecutive_failures_stop_the_run_naming_the_reward_and_the_checkpoint(tmp_path):
    from scalerl.core.errors import RunFailure

    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text("def score(response, truth):\n    if response == 'good':\n        return 1.0\n"
                           "    raise KeyError('missing field')\n")
    computer = RewardComputer(f"{reward_file}:score", max_consecutive_failures=5)
    computer.last_good_checkpoint = lambda: "/runs/x/checkpoints/step_4 (continue from it with trainer.resume=auto)"
    assert computer.compute(["bad"] * 4 + ["good"] + ["bad"] * 4, ROWS * 9)[1] == 8  # a success resets the count
    with pytest.raises(RewardFailureLimit) as raised:
        computer.compute(["bad"], ROWS)
    message = str(raised.value)
    assert isinstance(raised.value, RunFailure) and raised.value.exit_code == 1
    assert f"'{reward_file}:score'" in message and "5 samples in a row" in message
    assert "data.max_reward_failures=5" in message and "KeyError('missing field')" in message
    assert message.endswith("Last good checkpoint: /runs/x/checkpoints/step_4 (continue from it with trainer.resume=auto)")
    assert RewardComputer(exits).compute(["a"] * 300, ROWS * 300)[1] == 300  # 0 = never stop (the default here)


def test_a_reward_that_times_out_on_its_whole_first_batch_stops_the_run_at_once(tmp_path):
    """Not after data.max_reward_failures samples, at a timeout per batch (minutes): the message names the
    reward, how many samples timed out, why, and the fix."""
    reward_file = tmp_path / "slow_reward.py"
    reward_file.write_text("import time\n\n\ndef score(response, truth):\n    time.sleep(60)\n")
    computer = RewardComputer(f"{reward_file}:score", timeout_s=0.2, max_consecutive_failures=256)
    computer.last_good_checkpoint = lambda: "none yet"
    start = time.monotonic()
    with pytest.raises(RewardFailureLimit) as raised:
        computer.compute(["a"] * 4, ROWS * 4)
    assert time.monotonic() - start < 3.0
    message = str(raised.value)
    assert message.startswith(f"reward '{reward_file}:score' timed out on all 4 samples of the batch and has scored "
                              "none of the run's 4 samples so far; the last one: score ")
    assert "data.reward_timeout_s=0.2 s" in message and "rather than wait out data.max_reward_failures=256" in message
    assert message.endswith("fix the reward function so that it returns within data.reward_timeout_s=0.2 s, or "
                            "raise data.reward_timeout_s if it is only slow. Last good checkpoint: none yet")


def test_timeouts_of_a_reward_that_has_scored_or_of_part_of_a_batch_count_toward_the_limit_only():
    computer = RewardComputer(hangs_on_some, timeout_s=0.2, max_consecutive_failures=256)
    assert computer.compute(["hang", "ok"], ROWS * 2) == ([0.0, 1.0], 1)  # part of the first batch
    assert computer.compute(["hang"] * 3, ROWS * 3) == ([0.0] * 3, 3)  # a whole batch, after a sample scored
    raising = RewardComputer(exits, max_consecutive_failures=256)  # failing fast: the limit comes soon anyway
    assert raising.compute(["a"] * 4, ROWS * 4) == ([0.0] * 4, 4)
    assert RewardComputer(sleeps, timeout_s=0.2).compute(["a"] * 2, ROWS * 2) == ([0.0] * 2, 2)  # 0 = never stop
