"""The built-in arithmetic task: determinism, disjoint splits, levels, answers and errors."""

import doctest
from collections import Counter

import pytest

import scalerl.data.arithmetic as arithmetic
from scalerl.data.arithmetic import count_arithmetic_problems, make_arithmetic_rows
from scalerl.data.errors import DataError
from scalerl.data.rewards.computer import extract_hash_answer, gsm8k_reward


def test_docstring_example():
    assert doctest.testmod(arithmetic).failed == 0


def test_same_seed_same_rows_and_different_seed_different_rows():
    first = make_arithmetic_rows("train", 50, [1, 2, 3, 4], seed=3)
    assert first == make_arithmetic_rows("train", 50, [1, 2, 3, 4], seed=3)
    assert first != make_arithmetic_rows("train", 50, [1, 2, 3, 4], seed=4)


@pytest.mark.parametrize("level", [1, 2, 4])
def test_train_and_test_never_share_a_problem(level):
    train, test = (
        {row["prompt"] for row in make_arithmetic_rows(split, count_arithmetic_problems(split, level), level, 0)}
        for split in ("train", "test")
    )
    assert train and test and not train & test
    assert 0.1 < len(test) / (len(train) + len(test)) < 0.3


def test_big_level_splits_are_disjoint_too():
    train = {row["prompt"] for row in make_arithmetic_rows("train", 2000, 3, 0)}
    test = {row["prompt"] for row in make_arithmetic_rows("test", 2000, 3, 0)}
    assert len(train) == 2000 and len(test) == 2000 and not train & test


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_rows_are_correct_short_and_in_gsm8k_format(level):
    rows = make_arithmetic_rows("train", 60, level, seed=1)
    assert len({row["prompt"] for row in rows}) == 60
    for row in rows:
        expression = row["prompt"].removeprefix("Q:").removesuffix("\nA:")
        assert str(eval(expression)) == row["ground_truth"]  # the expressions are plain Python arithmetic
        assert int(row["ground_truth"]) >= 0 and row["difficulty"] == level
        assert extract_hash_answer(row["response"]) == row["ground_truth"]
        assert gsm8k_reward(row["response"], row["ground_truth"]) == 1.0
        assert len(row["prompt"]) + len(row["response"]) <= 32
        scratchpad = row["response"].split("####")[0].strip()
        if scratchpad:  # the scratchpad is itself a correct intermediate expression
            assert eval(scratchpad) == int(row["ground_truth"])


def test_mixed_levels_share_rows_and_small_levels_pass_on_their_remainder():
    counts = Counter(row["difficulty"] for row in make_arithmetic_rows("train", 90, [1, 1, 2], seed=0))
    assert counts == {1: 60, 2: 30}
    level_one = count_arithmetic_problems("train", 1)
    counts = Counter(row["difficulty"] for row in make_arithmetic_rows("train", 400, [1, 4], seed=0))
    assert counts == {1: level_one, 4: 400 - level_one}


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("valid", 5, 1, 0), "split 'valid'"),
        (("train", 5, 7, 0), "difficulty 7"),
        (("train", 5, [], 0), "difficulty"),
        (("train", -1, 1, 0), "num_rows=-1"),
        (("test", 1000, 1, 0), "only .* distinct test problems"),
    ],
)
def test_bad_arguments_raise_clear_errors(arguments, message):
    with pytest.raises(DataError, match=message):
        make_arithmetic_rows(*arguments)
