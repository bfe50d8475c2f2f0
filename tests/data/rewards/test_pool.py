"""Rewards in a pool of worker processes (`data.reward_workers`): the same scores as in-process for every
accepted signature and the built-ins, hanging calls that overlap under one deadline, workers that crash or
ignore their timeout replaced, workers gone after the run."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from scalerl.cli import main
from scalerl.data.rewards.computer import RewardComputer, RewardFailureLimit, RewardFunctionError, gsm8k_reward
from scalerl.data.rewards.pool import RewardPool, RewardPoolError
from tests.tiny import tiny_overrides

# A reward file with one function per accepted signature, and one that misbehaves on request.
REWARDS_PY = textwrap.dedent("""
    import os, signal, time

    def scalerl_score(response, ground_truth, row=None):
        return float(response.strip().endswith(str(ground_truth))) + (0.5 if row.get("data_source") else 0.0)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(str(ground_truth) in solution_str), "chars": float(len(solution_str)), "pred": "x",
                "has_extra": float(bool(extra_info))}

    def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [2.0 * (str(g) in s) for s, g in zip(solution_strs, ground_truths)]

    def trl_reward(prompts, completions, **columns):
        return [None if "####" not in c else float(len(c) % 3) for c in completions]

    def misbehaves(response, ground_truth):
        if response == "hang":
            time.sleep(3600)
        if response == "exit":
            os._exit(3)
        if response == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if response == "swallow":  # a retry loop that catches even the timeout
            while True:
                try:
                    time.sleep(3600)
                except BaseException:
                    pass
        if response == "raise":
            raise ValueError("bad sample")
        return float(response == ground_truth)
""")

# Responses and rows of GSM8K and MATH sources: boxed fractions, several answers, none.
CORPUS = [
    ("The sum is 12.\n#### 12", {"ground_truth": "12", "data_source": "openai/gsm8k"}),
    ("#### 1,234", {"ground_truth": "1234", "data_source": "openai/gsm8k"}),
    ("I think 7", {"ground_truth": "7", "data_source": "openai/gsm8k", "extra_info": {"index": 3}}),
    ("so \\boxed{\\frac{1}{2}}.", {"ground_truth": "\\frac{1}{2}", "data_source": "lighteval/MATH"}),
    ("\\boxed{3} then \\boxed{4}", {"ground_truth": "4", "data_source": "HuggingFaceH4/MATH-500"}),
    ("no answer at all", {"ground_truth": "5", "data_source": "lighteval/MATH", "extra_info": {"level": 2}}),
    ("#### 9", {"ground_truth": "9"}),
    ("#### 10 dollars", {"ground_truth": "10"}),
]
ALL_STYLES = "gsm8k,math,auto,{f}:scalerl_score,{f}:compute_score,{f}:compute_score_batch,{f}:trl_reward"


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "pool_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def _samples(count=len(CORPUS)):
    responses = [CORPUS[i % len(CORPUS)][0] for i in range(count)]
    return responses, [dict(CORPUS[i % len(CORPUS)][1]) for i in range(count)]


def test_the_pool_scores_as_in_process_for_every_signature_and_built_in(rewards_file):
    spec = ALL_STYLES.format(f=rewards_file)
    responses, rows = _samples(24)  # more samples than workers: the batched functions are split among them
    weights = [1.0, 2.0, 0.5, 1.0, -1.0, 0.25, 3.0]
    in_process = RewardComputer(spec, weights=weights)
    expected = in_process.compute(responses, rows)
    expected_scores = in_process.sample_scores(responses, rows)
    with_pool = RewardComputer(spec, weights=weights, workers=2)
    try:
        assert with_pool.compute(responses, rows) == expected
        assert with_pool.last_metrics == in_process.last_metrics
        assert "reward/extra/compute_score/chars" in with_pool.last_metrics  # verl's extras came back
        assert with_pool.sample_scores(responses, rows) == expected_scores
    finally:
        with_pool.close()
    assert expected[1] == 0 and len(set(expected[0])) > 3  # the corpus tells the functions apart


def test_a_callable_runs_in_the_pool_by_its_module_name_and_a_lambda_is_refused():
    responses, rows = _samples()
    computer = RewardComputer(gsm8k_reward, workers=1)
    try:
        assert computer.compute(responses, rows) == RewardComputer(gsm8k_reward).compute(responses, rows)
    finally:
        computer.close()
    with pytest.raises(RewardFunctionError, match="cannot run in data.reward_workers processes"):
        RewardComputer(lambda response, ground_truth: 1.0, workers=1)


def test_one_hanging_call_costs_one_timeout_and_the_others_are_scored(rewards_file):
    computer = RewardComputer(f"{rewards_file}:misbehaves", timeout_s=1.0, workers=2)
    try:
        computer.compute(["1"], [{"ground_truth": "1"}])  # the workers are up
        responses = [str(i) for i in range(15)] + ["hang"]
        started = time.monotonic()
        scores, failures = computer.compute(responses, [{"ground_truth": str(i)} for i in range(16)])
        elapsed = time.monotonic() - started
    finally:
        computer.close()
    assert scores == [1.0] * 15 + [0.0] and failures == 1
    assert 0.9 < elapsed < 2.5, elapsed


def test_a_reward_that_always_hangs_costs_about_one_timeout_per_batch_not_samples_times_timeout(rewards_file):
    computer = RewardComputer(f"{rewards_file}:misbehaves", timeout_s=1.0, workers=2)
    rows = [{"ground_truth": "1"}] * 16
    try:
        started = time.monotonic()
        computer.compute(["1"], rows[:1])
        startup_s = time.monotonic() - started  # spawning the workers: the second batch starts fresh ones
        durations = []
        for _ in range(2):
            started = time.monotonic()
            assert computer.compute(["hang"] * 16, rows) == ([0.0] * 16, 16)
            durations.append(time.monotonic() - started)
    finally:
        computer.close()
    # One call after another: 16 s a batch; spread over the 2 workers: 8 s. Overlapped: ~2 s, then ~1 s plus
    # starting the workers that replace the two killed at the first batch's deadline (slow on a busy machine).
    assert durations[0] < 6.0 and durations[1] < 5.0 + startup_s, (durations, startup_s)


def test_a_crashed_worker_fails_its_call_and_the_pool_recovers(rewards_file, caplog):
    computer = RewardComputer(f"{rewards_file}:misbehaves", timeout_s=5.0, workers=2)
    rows = [{"ground_truth": str(i)} for i in range(6)]
    try:
        with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
            scores, failures = computer.compute(["0", "exit", "2", "segv", "4", "raise"], rows)
        assert scores == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0] and failures == 3
        assert computer.pool.replaced == 2
        assert computer.compute([str(i) for i in range(6)], rows) == ([1.0] * 6, 0)  # recovered
    finally:
        computer.close()
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert "exit code 3" in logged or "SIGSEGV" in logged  # a crash is logged once, the first kind seen
    assert "ValueError('bad sample')" in logged  # the worker's exception, by its own repr


def test_a_call_that_ignores_its_timeout_is_killed_and_replaced(rewards_file):
    computer = RewardComputer(f"{rewards_file}:misbehaves", timeout_s=0.5, workers=1)
    try:
        (score,) = computer.sample_scores(["swallow"], [{"ground_truth": "1"}])[0]
        assert "killed and replaced" in score.problem
        assert computer.pool.replaced == 1
        assert computer.compute(["1"], [{"ground_truth": "1"}]) == ([1.0], 0)
    finally:
        computer.close()


def test_failures_in_the_pool_count_towards_max_reward_failures(rewards_file):
    computer = RewardComputer(f"{rewards_file}:misbehaves", workers=2, max_consecutive_failures=4)
    try:
        with pytest.raises(RewardFailureLimit, match="misbehaves"):
            computer.compute(["raise", "exit", "raise", "raise"], [{"ground_truth": "1"}] * 4)
    finally:
        computer.close()


def test_close_ends_every_worker(rewards_file):
    pool = RewardPool([f"{rewards_file}:misbehaves"], None, 3, 1.0)
    processes = [worker.process for worker in pool._workers]
    assert len(processes) == 3 and all(p.is_alive() for p in processes)
    pool.close()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([(0, ("1", "1"), {})])


def test_workers_exit_when_their_trainer_is_killed(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text("import os, signal\n"
                      "from scalerl.data.rewards.pool import RewardPool\n"
                      "if __name__ == '__main__':\n"
                      "    pool = RewardPool(['gsm8k'], None, 2, 5.0)\n"
                      "    pool.run([(0, ('#### 1', '1'), {})] * 4)\n"
                      "    print(' '.join(str(w.process.pid) for w in pool._workers), flush=True)\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids = [int(pid) for pid in result.stdout.split()]
    assert len(pids) == 2 and result.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_reward_that_cannot_load_in_the_workers_is_an_error_naming_why(tmp_path):
    path = tmp_path / "main_only.py"
    path.write_text("import multiprocessing\n"
                    "if multiprocessing.current_process().name != 'MainProcess':\n"
                    "    raise ImportError('needs the trainer process')\n"
                    "def score(response, ground_truth):\n    return 1.0\n")
    computer = RewardComputer(f"{path}:score", workers=1)
    with pytest.raises(RewardPoolError, match="needs the trainer process"):
        computer.compute(["a"], [{"ground_truth": "a"}])
    computer.close()


def test_training_with_reward_workers_logs_rewards_and_leaves_no_worker(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *tiny_overrides(), f"trainer.output_dir={run}", "trainer.total_steps=2",
                 "data.reward=gsm8k", "data.reward_workers=2"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [row for row in steps if "critic/score/mean" in row]
    assert len(scored) == 2 and all(row["reward/num_failures"] == 0 for row in scored)
    assert multiprocessing.active_children() == []
