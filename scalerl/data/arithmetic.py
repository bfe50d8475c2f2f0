"""The built-in task: seeded, procedurally generated arithmetic with four difficulty levels.

Row format (shared by the whole `scalerl.data` package)::

    {"prompt": str, "response": str, "ground_truth": str}

- `prompt` is the text the model continues;
- `response` is the supervised (SFT) target that follows the prompt: it starts with a space and ends
  with GSM8K's answer marker, `#### <number>`;
- `ground_truth` is the exact answer string that `scalerl.data.rewards.specs.gsm8k_reward` checks.
Rows may carry extra metadata keys (arithmetic rows add `"difficulty": int`); consumers ignore them.

The texts are deliberately short because the built-in run trains a 2-layer character-level model on
a laptop CPU. A level gets a scratchpad only where a small model needs the intermediate step:

    level 1  single-digit addition              "Q:3+5\\nA:"      " #### 8"
    level 2  two-digit addition / subtraction   "Q:52-17\\nA:"    " #### 35"      (results >= 0)
    level 3  three two-digit addends            "Q:23+45+12\\nA:" " 68+12 #### 80"
             or single-digit multiplication     "Q:7*8\\nA:"      " #### 56"
    level 4  two-digit times one-digit          "Q:47*8\\nA:"     " 320+56 #### 376"

Train and test never share a problem: the split of a problem is fixed by a CRC32 hash of its
expression (about `TEST_FRACTION` of every level is test), so it does not depend on the seed or on
how many rows are asked for. Within a split, the rows of one call are distinct problems.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from scalerl.data.errors import DataError

SPLITS = ("train", "test")
TEST_FRACTION = 0.2
LEVEL_DESCRIPTIONS = {
    1: "single-digit addition",
    2: "two-digit addition and subtraction (non-negative results)",
    3: "two-digit addition with three operands, or single-digit multiplication",
    4: "two-digit times one-digit multiplication",
}
# Families up to this size are enumerated once per split; bigger ones are sampled by rejection.
_ENUMERATION_LIMIT = 50_000


@dataclass(frozen=True)
class _ProblemFamily:
    """All problems of one shape, numbered 0..size-1, so a random index is a random problem."""

    name: str
    size: int
    problem: Callable[[int], tuple[str, str, int]]  # index -> (expression, scratchpad, answer)


def _single_digit_addition(index: int) -> tuple[str, str, int]:
    a, b = divmod(index, 10)
    return f"{a}+{b}", "", a + b


def _two_digit_addition(index: int) -> tuple[str, str, int]:
    a, b = (10 + part for part in divmod(index, 90))
    return f"{a}+{b}", "", a + b


@lru_cache(maxsize=1)
def _subtraction_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10, 100) for b in range(10, a + 1)]


def _two_digit_subtraction(index: int) -> tuple[str, str, int]:
    a, b = _subtraction_pairs()[index]
    return f"{a}-{b}", "", a - b


def _three_addends(index: int) -> tuple[str, str, int]:
    ab, c = divmod(index, 90)
    a, b = divmod(ab, 90)
    a, b, c = a + 10, b + 10, c + 10
    return f"{a}+{b}+{c}", f"{a + b}+{c}", a + b + c


def _single_digit_multiplication(index: int) -> tuple[str, str, int]:
    a, b = divmod(index, 10)
    return f"{a}*{b}", "", a * b


def _two_by_one_digit_multiplication(index: int) -> tuple[str, str, int]:
    a, b = divmod(index, 8)
    a, b = a + 10, b + 2  # times 0 or 1 would teach nothing
    tens, units = divmod(a, 10)
    return f"{a}*{b}", f"{tens * 10 * b}+{units * b}", a * b


_LEVELS: dict[int, tuple[_ProblemFamily, ...]] = {
    1: (_ProblemFamily("single-digit addition", 100, _single_digit_addition),),
    2: (
        _ProblemFamily("two-digit addition", 90 * 90, _two_digit_addition),
        _ProblemFamily("two-digit subtraction", 90 * 91 // 2, _two_digit_subtraction),
    ),
    3: (
        _ProblemFamily("three two-digit addends", 90**3, _three_addends),
        _ProblemFamily("single-digit multiplication", 100, _single_digit_multiplication),
    ),
    4: (_ProblemFamily("two-digit times one-digit", 90 * 8, _two_by_one_digit_multiplication),),
}


def make_arithmetic_rows(split: str, num_rows: int, difficulty: int | list[int], seed: int) -> list[dict]:
    """`num_rows` distinct arithmetic problems of one split, in the package's row format.

    `difficulty` is a level (1-4) or a list of levels; rows are shared out in the list's proportions
    (`[1, 2]` half and half, `[1, 1, 2]` two thirds level 1), and within a level evenly over its
    problem shapes; a level or shape with too few problems passes its remainder to the others.
    The same arguments always give the same rows, in the same (shuffled) order.
    Raises `DataError` for a split other than "train"/"test", an unknown level, or more rows than the
    levels have problems in the split.

    >>> rows = make_arithmetic_rows("train", 2, difficulty=4, seed=0)
    >>> sorted(rows[0])
    ['difficulty', 'ground_truth', 'prompt', 'response']
    >>> rows[0]["prompt"].startswith("Q:"), rows[0]["response"].endswith("#### " + rows[0]["ground_truth"])
    (True, True)
    """
    if split not in SPLITS:
        raise DataError(f"arithmetic split {split!r} is not one of {SPLITS}")
    levels = [difficulty] if isinstance(difficulty, int) and not isinstance(difficulty, bool) else difficulty
    if not isinstance(levels, (list, tuple)) or not levels or any(
        isinstance(level, bool) or level not in _LEVELS for level in levels
    ):
        raise DataError(f"arithmetic difficulty {difficulty!r} must be a level in {sorted(_LEVELS)} or a list of them")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise DataError(f"num_rows={num_rows!r} must be a non-negative integer")
    weights = Counter(levels)
    capacities = {level: sum(_capacity(family, split) for family in _LEVELS[level]) for level in weights}
    rows_per_level = _share_out(num_rows, weights, capacities)
    if sum(rows_per_level.values()) < num_rows:
        available = sum(count_arithmetic_problems(split, level) for level in weights)
        raise DataError(
            f"asked for {num_rows} {split} rows of arithmetic difficulty {difficulty!r}, but "
            f"{'that level has' if len(weights) == 1 else 'those levels have'} only {available} distinct "
            f"{split} problems; ask for fewer rows or add levels"
        )
    rows: list[dict] = []
    for level in sorted(rows_per_level):
        rng = random.Random(f"arithmetic:{split}:{level}:{seed}")
        rows.extend(_level_rows(level, split, rows_per_level[level], rng))
    random.Random(f"arithmetic-order:{split}:{seed}").shuffle(rows)
    return rows


def count_arithmetic_problems(split: str, level: int) -> int:
    """How many distinct problems `level` has in `split` (the most rows one call can ask for)."""
    if split not in SPLITS or level not in _LEVELS:
        raise DataError(f"unknown arithmetic split {split!r} or level {level!r}")
    return sum(len(_split_indices(family, split)) for family in _LEVELS[level])


def _level_rows(level: int, split: str, count: int, rng: random.Random) -> list[dict]:
    families = _LEVELS[level]
    shares = _share_out(
        count, {family.name: 1 for family in families}, {family.name: _capacity(family, split) for family in families}
    )
    rows = []
    for family in families:
        for index in _draw_indices(family, split, shares[family.name], rng, level):
            expression, scratchpad, answer = family.problem(index)
            rows.append(_format_row(expression, scratchpad, answer, level))
    return rows


def _share_out(count: int, weights: dict, capacities: dict) -> dict:
    """Split `count` in proportion to `weights`, never giving a key more than its capacity.

    Keys that run out (level 1 has ~76 train problems) hand their remainder to the others, so the
    result sums to less than `count` only when all capacities together are too small.
    """
    shares = {}
    remaining, remaining_weight = count, sum(weights.values())
    for key in sorted(weights, key=lambda key: capacities[key] / weights[key]):
        fair_share = -(-remaining * weights[key] // remaining_weight)  # ceiling division
        shares[key] = min(fair_share, capacities[key])
        remaining -= shares[key]
        remaining_weight -= weights[key]
    return shares


def _capacity(family: _ProblemFamily, split: str) -> int:
    """Problems of `family` in `split`: exact for small families, the family size (a bound) for big ones."""
    return len(_split_indices(family, split)) if family.size <= _ENUMERATION_LIMIT else family.size


def _draw_indices(family: _ProblemFamily, split: str, count: int, rng: random.Random, level: int) -> list[int]:
    """`count` distinct problem indices of `family` that belong to `split`."""
    expected_in_split = family.size * (TEST_FRACTION if split == "test" else 1 - TEST_FRACTION)
    if family.size <= _ENUMERATION_LIMIT or count * 4 > expected_in_split:
        pool = _split_indices(family, split)
        if count > len(pool):
            raise DataError(
                f"asked for {count} {split} problems of {family.name} (arithmetic level {level}), "
                f"but only {len(pool)} exist; ask for fewer rows"
            )
        return rng.sample(pool, count)
    # A big family, asked for a small part of it: rejection sampling is quick and needs no enumeration.
    chosen: list[int] = []
    seen: set[int] = set()
    while len(chosen) < count:
        index = rng.randrange(family.size)
        if index not in seen:
            seen.add(index)
            if _split_of(family.problem(index)[0]) == split:
                chosen.append(index)
    return chosen


@lru_cache(maxsize=None)
def _split_indices(family: _ProblemFamily, split: str) -> list[int]:
    return [index for index in range(family.size) if _split_of(family.problem(index)[0]) == split]


def _split_of(expression: str) -> str:
    """The split a problem belongs to, fixed by its text alone (stable across runs and platforms)."""
    return "test" if zlib.crc32(expression.encode()) % 1000 < TEST_FRACTION * 1000 else "train"


def _format_row(expression: str, scratchpad: str, answer: int, level: int) -> dict:
    work = f" {scratchpad}" if scratchpad else ""
    return {
        "prompt": f"Q:{expression}\nA:",
        "response": f"{work} #### {answer}",
        "ground_truth": str(answer),
        "difficulty": level,
    }
