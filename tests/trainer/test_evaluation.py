"""Held-out scoring: a reward that cannot take the validation rows says it was the validation rows (the line
at start says where they come from), not merely "the rows"."""

from __future__ import annotations

import pytest

from scalerl.data.rewards.computer import RewardComputer
from scalerl.data.rewards.functions import RewardFunctionError
from scalerl.trainer.evaluation import scored_validation


def accuracy(prompts, completions, solution, **kwargs):  # a TRL reward needing the dataset's own column
    return [float(c == s) for c, s in zip(completions, solution)]


def test_a_reward_missing_a_column_of_the_validation_rows_names_them():
    reward = RewardComputer([accuracy])
    assert scored_validation(reward, ["2"], [{"prompt": "1+1=", "columns": {"solution": "2"}}])[0] == [1.0]
    with pytest.raises(RewardFunctionError, match=r"^scoring the validation rows: reward accuracy needs 'solution', "
                                                  r"which the rows do not give \(columns: \['difficulty'"):
        scored_validation(reward, ["2"], [{"prompt": "1+1=", "ground_truth": "2", "difficulty": 1}])
