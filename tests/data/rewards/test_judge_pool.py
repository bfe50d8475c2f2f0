"""The generative judge in its own pool of worker processes (data.judge.workers): the same verdicts and raw
answers as the judge in process (a call cut as the in-process judge batches it), answers without a verdict
still counted failures with their text, a judge past its limit killed (its samples counted failures), a judge
that cannot load an error naming data.judge.model, and in
training the judging of a part beginning before the step's generation has ended, with the step's scores
those of the in-process judge."""

from __future__ import annotations

import logging
import os
import signal
from types import SimpleNamespace

import pytest

from scalerl.core.config import load_config
from scalerl.data.rewards.computer import RewardComputer
from scalerl.data.rewards import judge_pool
from scalerl.data.rewards.judge import judge_from_section
from scalerl.data.rewards.judge_pool import (
    JudgePool,
    JudgePoolError,
    PooledJudge,
    call_tasks,
)
from tests.spawned_group import start_method
from tests.tiny import save_tiny_teacher, tiny_overrides

# The judge workers fork from the fork server the multi-process tests' ranks fork from: where these tests start
# it, it imports what those ranks need too (the pool adds the judge's modules to the list, never replaces it).
start_method()

ROWS = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(8)]
# A random tiny judge greedily repeats the last token it read (tests/data/rewards/test_judge.py), so with the
# response last in the template its one-token answer is the response's last character: a grade where that is
# a digit, no verdict where it is a letter.
RESPONSES = ["4", "x", "7", "2", "ab", "9", "q", "13"]


def judge_section(model: str, **changes) -> SimpleNamespace:
    fields = {"model": model, "tokenizer": None, "template": "Q: {prompt} A: {response}", "verdict": "number",
              "max_score": 9.0, "labels": "correct=1,incorrect=0", "max_new_tokens": 1, "batch_size": 3,
              "chat_template": False, "dtype": "float32", "engine": "builtin"}
    return SimpleNamespace(**{**fields, **changes})


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return str(save_tiny_teacher(tmp_path_factory.mktemp("judge") / "judge", 3))


def test_a_call_is_cut_as_the_in_process_judge_batches_it():
    assert call_tasks("number", 3, 8) == [(0, 3), (3, 6), (6, 8)]
    assert call_tasks("label", 16, 5) == [(0, 5)]
    assert call_tasks("pairwise", 2, 6) == [(0, 6)]  # comparisons are batched over the call's groups
    assert call_tasks("number", 3, 0) == [(0, 0)]


def test_two_workers_give_the_in_process_judges_verdicts_and_count_answers_without_one(judge_dir, caplog):
    section = judge_section(judge_dir)
    in_process = judge_from_section(section, "cpu")
    prompts, truths = [r["prompt"] for r in ROWS], [r["ground_truth"] for r in ROWS]
    expected = in_process(prompts, RESPONSES, ground_truth=truths)
    assert any(isinstance(v, str) for v in expected) and any(isinstance(v, float) for v in expected)
    pool = JudgePool(section, "cpu", workers=2, timeout_s=60.0)
    try:
        pool.wait_ready()
        call = pool.submit(prompts, RESPONSES, truths)
        verdicts, texts = pool.result(call)
        assert verdicts == expected and texts == in_process.last_texts
        assert len(pool.calls) == 3 and len({pid for pid, _, _ in pool.calls}) == 2  # 3 batches over both workers

        judge = PooledJudge(pool)
        computer = RewardComputer(judge)
        assert computer.overlaps
        computer.start(RESPONSES, ROWS)  # the judging starts here; compute takes the verdicts
        assert len(judge._prefetched) == 1
        with caplog.at_level(logging.WARNING):
            scores, failures = computer.compute(RESPONSES, ROWS)
        assert not judge._prefetched and len(pool.calls) == 6  # the prefetched call was the one computed
        assert failures == sum(isinstance(v, str) for v in expected)  # counted, not a silent 0
        assert scores == [0.0 if isinstance(v, str) else v for v in expected]
        assert "no verdict in the judge's answer" in caplog.text and judge.last_texts == texts

        os.kill(pool._workers[0].process.pid, signal.SIGKILL)  # an idle worker that dies is replaced
        verdicts, _ = pool.result(pool.submit(prompts, RESPONSES, truths))
        assert verdicts == expected and pool.replaced == 1
    finally:
        pool.close()


def test_a_pairwise_call_is_one_task_with_the_in_process_verdicts(judge_dir):
    section = judge_section(judge_dir, verdict="pairwise", template="{prompt} {response_a} or {response_b}")
    prompts = ["p0"] * 3 + ["p1"] * 2
    responses = ["xA", "yB", "zA", "B", "A"]
    expected = judge_from_section(section, "cpu")(prompts, responses)
    pool = JudgePool(section, "cpu", workers=1, timeout_s=60.0)
    try:
        verdicts, _ = pool.result(pool.submit(prompts, responses, [None] * 5))
        assert verdicts == expected and len(pool.calls) == 1
    finally:
        pool.close()


def test_a_judge_that_cannot_load_is_an_error_naming_its_model(tmp_path):
    pool = JudgePool(judge_section(str(tmp_path / "missing")), "cpu", workers=1, timeout_s=5.0)
    try:
        with pytest.raises(JudgePoolError, match=r"cannot load the judge \(data.judge.model='.*missing'\)"):
            pool.wait_ready()
    finally:
        pool.close()


def test_training_judges_each_part_while_the_next_generates(judge_dir, tmp_path):
    """data.judge.workers=2, data.judge.parts=4: the rank's generation runs as 4 calls, the judge's first task
    begins (and, as the last generation waits for it, ends) before the last of them ends: the first parts were
    handed to the pool as they arrived, not after the batch. The step's scores and failures are the in-process
    judge's."""
    import time

    from scalerl.trainer.rl_trainer import RLTrainer

    def run(workers: int):
        cfg = load_config(None, tiny_overrides(
            f"trainer.output_dir={tmp_path / f'run{workers}'}", "data.reward=judge", f"data.judge.model={judge_dir}",
            "data.judge.max_new_tokens=1", "data.judge.max_score=9", "data.judge.template='Q: {prompt} A: {response}'",
            "data.judge.batch_size=2", f"data.judge.workers={workers}", "data.judge.parts=4", "rollout.max_new_tokens=3"))
        batches, windows = [], []
        trainer = RLTrainer.from_config(cfg, on_batch=batches.append)
        generate = trainer.rollouts.engine.generate

        def timed(*args, **kwargs):
            if workers and len(windows) == 3:  # the last part: a judge task of the first ones finishes meanwhile
                deadline = time.monotonic() + 60
                while not trainer.reward.functions[0].fn.pool.calls and time.monotonic() < deadline:
                    time.sleep(0.01)
            began = time.monotonic()
            out = generate(*args, **kwargs)
            windows.append((began, time.monotonic()))
            return out

        trainer.rollouts.engine.generate = timed
        try:
            metrics = trainer.train_step()
            calls = list(trainer.reward.functions[0].fn.pool.calls) if workers else []
        finally:
            trainer.close()
        return batches[0], metrics, windows, calls

    pooled, pooled_metrics, windows, calls = run(2)
    assert len(windows) == 4  # 4 prompts x 4 samples generated as 4 parts of one group each
    assert len(calls) == 8  # 4 parts of 4 rows, each in judge batches of 2
    assert min(began for _, began, _ in calls) < windows[-1][1]  # judging began before generation ended
    alone, alone_metrics, windows, _ = run(0)
    assert len(windows) == 1  # in process: one generation, judged after it
    assert pooled.response_ids.tolist() == alone.response_ids.tolist()  # the parts' samples are the whole's
    assert pooled.scores.tolist() == alone.scores.tolist()
    assert pooled_metrics["reward/num_failures"] == alone_metrics["reward/num_failures"] > 0


def test_a_judge_past_its_limit_is_killed_and_its_samples_are_counted_failures(judge_dir, monkeypatch, caplog):
    """A task running past data.reward_timeout_s (+ the kill grace, 0 here) has its worker killed and replaced;
    the call's samples fail, counted and logged by the reward computer, and the pool judges on afterwards."""
    monkeypatch.setattr(judge_pool, "KILL_GRACE_S", 0.0)
    pool = JudgePool(judge_section(judge_dir, max_new_tokens=400), "cpu", workers=1, timeout_s=0.01)
    try:
        pool.wait_ready()
        with caplog.at_level(logging.WARNING):
            scores, failures = RewardComputer(PooledJudge(pool), timeout_s=60.0).compute(RESPONSES, ROWS)
        assert failures == len(ROWS) and scores == [0.0] * len(ROWS) and pool.replaced >= 1
        assert "the judge did not answer within data.reward_timeout_s=0.01 s" in caplog.text
        pool.timeout_s = 60.0
        pool.wait_ready()
        verdicts, texts = pool.result(pool.submit(["1+1="], ["2"], ["2"]))
        assert len(verdicts) == 1 and len(texts[0]) > 0
    finally:
        pool.close()
