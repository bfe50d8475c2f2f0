"""Built-in arithmetic task, data files (GSM8K/MATH, verl's and TRL's formats, Hugging Face datasets; the row
contract: `loaders`), answer extraction and reward functions (the `rewards` wing; each call within
`data.reward_timeout_s`: `rewards.calls`)."""

from scalerl.data.answers import (
    extract_boxed,
    extract_hash_answer,
    normalize_math_answer,
)
from scalerl.data.arithmetic import (
    LEVEL_DESCRIPTIONS,
    count_arithmetic_problems,
    make_arithmetic_rows,
)
from scalerl.data.errors import DataError
from scalerl.data.formats import ColumnNames, reward_columns
from scalerl.data.loaders import DEFAULT_PROMPT_TEMPLATE, load_rows
from scalerl.data.rewards.computer import (
    BUILTIN_REWARDS,
    RewardComputer,
    RewardFunctionError,
    gsm8k_reward,
    load_reward_fn,
    math_reward,
)

__all__ = [
    "BUILTIN_REWARDS", "ColumnNames", "DEFAULT_PROMPT_TEMPLATE", "DataError", "LEVEL_DESCRIPTIONS", "RewardComputer",
    "RewardFunctionError", "count_arithmetic_problems", "extract_boxed", "extract_hash_answer", "gsm8k_reward",
    "load_reward_fn", "load_rows", "make_arithmetic_rows", "math_reward", "normalize_math_answer",
    "reward_columns",
]
