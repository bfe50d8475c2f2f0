"""The built-in tool task's rows: deterministic by seed, operands by level, the ground truth the operator, train
and test disjoint; the data config makes them, and its reward is the exact final answer after the tool."""

import pytest

from scalerl.core.config import load_config
from scalerl.data.errors import DataError
from scalerl.data.sources import reward_from_config, rows_from_config
from scalerl.data.tool_arithmetic import (
    LEVEL_RANGES,
    count_tool_arithmetic_problems,
    final_answer,
    make_tool_arithmetic_rows,
    operator,
    tool_answer_reward,
    tool_call_text,
)


def test_rows_are_deterministic_by_seed_and_differ_between_seeds():
    a = make_tool_arithmetic_rows("train", 50, [1, 2, 3], seed=3)
    assert a == make_tool_arithmetic_rows("train", 50, [1, 2, 3], seed=3)
    assert [r["prompt"] for r in a] != [r["prompt"] for r in make_tool_arithmetic_rows("train", 50, [1, 2, 3], seed=4)]
    assert len({r["prompt"] for r in a}) == 50  # distinct problems


@pytest.mark.parametrize("level", sorted(LEVEL_RANGES))
def test_each_level_has_its_operand_sizes_and_the_ground_truth_is_the_operator(level):
    low, high = LEVEL_RANGES[level]
    for row in make_tool_arithmetic_rows("test", 20, level, seed=0):
        a, b = row["operands"]
        assert low <= a <= high and low <= b <= high and row["difficulty"] == level
        assert row["prompt"] == f"Q:{a}@{b}\nA:"
        assert row["ground_truth"] == str(a * b + a + b) == str(operator(a, b))
        assert row["response"] == f" #### {row['ground_truth']}"


def test_train_and_test_never_share_a_problem_and_levels_share_out_rows():
    train = {r["prompt"] for r in make_tool_arithmetic_rows("train", 2000, [1, 2], seed=0)}
    test = {r["prompt"] for r in make_tool_arithmetic_rows("test", 500, [1, 2], seed=0)}
    assert not train & test
    level_1 = count_tool_arithmetic_problems("train", 1)
    assert 60 < level_1 < 95  # about 80% of the 100 single-digit problems
    rows = make_tool_arithmetic_rows("train", 400, [1, 2], seed=0)
    assert sum(r["difficulty"] == 1 for r in rows) == level_1  # level 1 runs out, level 2 takes the rest
    with pytest.raises(DataError, match="only"):
        make_tool_arithmetic_rows("train", level_1 + 1, 1, seed=0)
    with pytest.raises(DataError, match="level"):
        make_tool_arithmetic_rows("train", 5, 4, seed=0)
    with pytest.raises(DataError, match="split"):
        make_tool_arithmetic_rows("val", 5, 1, seed=0)


def test_the_data_config_makes_the_task_and_scores_it_with_its_own_reward():
    cfg = load_config(None, ["data.task=tool_arithmetic", "data.difficulty=[2]", "data.num_train=30",
                             "data.num_val=10"])
    train, test = rows_from_config(cfg.data, "train", 1), rows_from_config(cfg.data, "test", 1)
    assert train == make_tool_arithmetic_rows("train", 30, [2], 1) and len(test) == 10
    reward = reward_from_config(cfg.data)  # data.reward=auto: the task's final-answer reward
    row = train[0]
    call = tool_call_text(*row["operands"])
    right = f"{call}{row['ground_truth']} #### {row['ground_truth']}"
    scores, _ = reward.compute([right, f"{call}{row['ground_truth']}"], [row, row])
    assert scores == [1.0, 0.0]


def test_the_final_answer_is_the_one_after_the_last_tool_call():
    assert tool_answer_reward(' #### 11', "11") == 1.0  # answered without the tool: still scored
    assert tool_answer_reward('<tool_call>{"name":"op","arguments":{"a":1,"b":5}}</tool_call>11 #### 11', "11") == 1.0
    assert tool_answer_reward('<tool_call>{"name":"op","arguments":{"a":1,"b":5}}</tool_call>11 #### 12', "11") == 0.0
    # a "####" before (or inside) the last call is not the final answer
    assert final_answer('#### 11<tool_call>{"name":"op","arguments":{"a":"#### 11"}}</tool_call>11') is None
    assert tool_answer_reward("#### 11<tool_call>{}</tool_call>", "11") == 0.0
