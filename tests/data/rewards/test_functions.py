"""verl's and TRL's reward functions run as they are: signatures detected, arguments as verl's reward managers
and TRL's GRPOTrainer pass them, dict scores with extra metrics, None as "not applicable", weights."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from scalerl.core.config import load_config
from scalerl.data.rewards.computer import (
    RewardComputer,
    RewardFunctionError,
    load_reward_fn,
    load_reward_fns,
    reward_from_config,
)
from scalerl.data.rewards.functions import SIGNATURES, reward_inputs

VERL_REWARDS = '''
seen = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    seen.append((data_source, solution_str, ground_truth, extra_info))
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else -0.5, "acc": correct, "pred": solution_str, "length": len(solution_str)}

def plain(data_source, solution_str, ground_truth, extra_info):
    return float(extra_info["weight"]) if solution_str == ground_truth else 0.0

def batched(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0]

def no_score_key(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
'''

TRL_REWARDS = '''
calls = []

def format_reward(completions, **kwargs):
    calls.append(kwargs)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.startswith("<think>") else 0.0 for t in texts]

def accuracy_reward(prompts, completions, solution, **kwargs):
    return [None if s is None else float(c.strip() == s) for c, s in zip(completions, solution)]

def needs_column(prompts, completions, difficulty_level):
    return [0.0] * len(completions)
'''


@pytest.fixture
def files(tmp_path):
    (tmp_path / "verl_rewards.py").write_text(VERL_REWARDS)
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    return tmp_path


def verl_row(truth, source="openai/gsm8k", **extra):
    return {"prompt": "q", "ground_truth": truth, "data_source": source, "extra_info": {"index": 0, **extra}}


def test_styles_are_detected_from_the_signature(files):
    styles = [f.style for f in load_reward_fns(
        f"{files}/verl_rewards.py:compute_score,{files}/verl_rewards.py:batched,{files}/trl_rewards.py:format_reward,"
        "gsm8k")]
    assert styles == ["verl", "verl_batch", "trl", "scalerl"]


@pytest.mark.parametrize("source", [
    "def f(x):\n    return 1.0\n",
    "def f(data_source, solution_str, ground_truth, extra_info, needed):\n    return 1.0\n",
    "def f(*, response):\n    return 1.0\n",
])
def test_a_function_fitting_no_signature_names_the_accepted_ones(tmp_path, source):
    (tmp_path / "bad.py").write_text(source)
    with pytest.raises(RewardFunctionError, match="must accept one of these signatures") as raised:
        load_reward_fn(f"{tmp_path}/bad.py:f")
    assert all(signature in str(raised.value) for signature in SIGNATURES.values())


def test_verl_function_gets_verl_arguments_and_its_extras_are_metrics(files):
    computer = RewardComputer(f"{files}/verl_rewards.py:compute_score")
    rows = [verl_row("7"), verl_row("7"), verl_row("8", source="lighteval/MATH")]
    scores, failures = computer.compute(["7", " 7 ", "9"], rows)
    assert (scores, failures) == ([1.0, 1.0, -0.5], 0)
    module = computer.reward_fn.__globals__
    assert module["seen"][2] == ("lighteval/MATH", "9", "8", {"index": 0})
    # bools and numbers become means; the text "pred" is dropped
    assert computer.last_metrics == {"reward/extra/acc": pytest.approx(2 / 3), "reward/extra/length": pytest.approx(5 / 3)}


def test_verl_functions_single_batched_and_broken(files):
    rows = [verl_row("a", weight=3), verl_row("b", weight=3)]
    assert RewardComputer(f"{files}/verl_rewards.py:plain").compute(["a", "x"], rows) == ([3.0, 0.0], 0)
    assert RewardComputer(f"{files}/verl_rewards.py:batched").compute(["a", "b"], rows) == ([1.0, 1.0], 0)
    assert RewardComputer(f"{files}/verl_rewards.py:short_batch").compute(["a", "b"], rows) == ([0.0, 0.0], 2)
    assert RewardComputer(f"{files}/verl_rewards.py:no_score_key").compute(["a"], rows[:1]) == ([0.0], 1)


def test_trl_functions_with_weights_none_and_columns(files, caplog):
    spec = f"{files}/trl_rewards.py:format_reward,{files}/trl_rewards.py:accuracy_reward"
    computer = RewardComputer(spec, weights=[0.5, 2.0])
    rows = [{"prompt": "p1", "columns": {"solution": "<think>4"}}, {"prompt": "p2", "columns": {"solution": None}},
            {"prompt": "p3", "columns": {"solution": "5"}}]
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
        scores, failures = computer.compute(["<think>4", "<think>x", "6"], rows)
    assert (scores, failures) == ([2.5, 0.5, 0.0], 0)  # 0.5 x format + 2 x accuracy; None adds nothing
    assert computer.last_metrics == {"reward/extra/format_reward": pytest.approx(2 / 3),
                                     "reward/extra/accuracy_reward": 0.5}  # the None left out of the mean
    kwargs = computer.functions[0].fn.__globals__["calls"][-1]
    assert kwargs["prompts"] == ["p1", "p2", "p3"] and kwargs["solution"] == ["<think>4", None, "5"]
    assert not caplog.records


def test_trl_conversational_prompts_get_message_completions(files):
    computer = RewardComputer(f"{files}/trl_rewards.py:format_reward")
    messages = [{"role": "user", "content": "hi"}]
    assert computer.compute(["<think>y", "n"], [{"prompt": messages}] * 2) == ([1.0, 0.0], 0)
    # Rows without "columns" pass their other keys as columns (the built-in rows' ground_truth, difficulty).
    computer.compute(["a"], [{"prompt": "p", "ground_truth": "1", "difficulty": 2}], completion_ids=[[5, 6]])
    kwargs = computer.functions[0].fn.__globals__["calls"][-1]
    assert kwargs["ground_truth"] == ["1"] and kwargs["difficulty"] == [2] and kwargs["completion_ids"] == [[5, 6]]


def test_trl_function_asking_for_a_missing_column_is_an_error_naming_it(files):
    computer = RewardComputer(f"{files}/trl_rewards.py:needs_column")
    with pytest.raises(RewardFunctionError, match="'difficulty_level'.*columns: \\['solution'\\]"):
        computer.compute(["a"], [{"prompt": "p", "columns": {"solution": "1"}}])


def test_every_function_returning_none_scores_zero_with_one_warning(caplog):
    computer = RewardComputer(lambda prompts, completions, **kw: [None] * len(completions))
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
        assert computer.compute(["a", "b"], [{"prompt": "p"}] * 2) == ([0.0, 0.0], 0)
    assert len(caplog.records) == 1 and "every reward function returned None" in caplog.records[0].getMessage()


def test_a_failing_term_counts_zero_and_the_sample_once(files):
    def explodes(response, ground_truth):
        raise RuntimeError("boom")

    computer = RewardComputer([explodes, "gsm8k"], weights=[1.0, 1.0])
    assert computer.compute(["#### 1", "#### 2"], [{"ground_truth": "1"}] * 2) == ([1.0, 0.0], 2)


def test_weights_must_match_the_functions():
    with pytest.raises(RewardFunctionError, match="2 weights for 1 reward functions"):
        RewardComputer("gsm8k", weights=[1.0, 2.0])


def test_reward_inputs_reads_verl_and_trl_rows():
    verl = reward_inputs({"prompt": [{"role": "user", "content": "q"}], "data_source": "openai/gsm8k",
                          "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train"}})
    assert (verl.ground_truth, verl.data_source, verl.extra_info, verl.has_ground_truth) == \
        ("72", "openai/gsm8k", {"split": "train"}, True)
    trl = reward_inputs({"prompt": "p", "columns": {"solution": "3"}})
    assert (trl.columns, trl.has_ground_truth, trl.ground_truth) == ({"solution": "3"}, False, None)


def test_reward_from_config_reads_the_reward_keys(files):
    cfg = load_config(None, [f"data.reward=gsm8k,{files}/trl_rewards.py:format_reward", "data.reward_weights=[1,0.25]",
                             "data.max_reward_failures=3", "data.reward_timeout_s=2"])
    computer = reward_from_config(cfg.data)
    assert [f.name for f in computer.functions] == ["gsm8k", "format_reward"]
    assert (computer.weights, computer.max_consecutive_failures, computer.timeout_s) == ([1.0, 0.25], 3, 2.0)
    auto = reward_from_config(SimpleNamespace(reward="auto", reward_timeout_s=1.0, reward_weights=[],
                                              max_reward_failures=0, task="arithmetic"))
    assert auto.compute(["#### 3"], [{"ground_truth": "3"}]) == ([1.0], 0)  # no data_source: the task's gsm8k


def test_same_named_functions_get_distinct_metric_names(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    computer = RewardComputer(f"{tmp_path}/a.py:score,{tmp_path}/b.py:score")
    computer.compute(["x"], [{"prompt": "p"}])
    assert sorted(computer.last_metrics) == ["reward/extra/score", "reward/extra/score_2"]

