"""Answer extraction, the GSM8K/MATH rewards, loading user reward functions, and failure-safe scoring."""

import doctest
import logging
import math

import pytest

import scalerl.data.answers as answers
from scalerl.data.rewards.computer import (
    RewardComputer,
    RewardFunctionError,
    extract_boxed,
    extract_hash_answer,
    gsm8k_reward,
    load_reward_fn,
    math_reward,
    normalize_math_answer,
)


def test_docstring_examples():
    assert doctest.testmod(answers).failed == 0


@pytest.mark.parametrize(
    "text, expected",
    [("x\n#### 72", "72"), ("#### 1,234.5", "1234.5"), ("####-3", "-3"), ("#### 1 then #### 2.", "2"),
     ("#### $18", "18"), ("no answer", None), ("#### abc", None)],
)
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


def test_gsm8k_reward():
    assert gsm8k_reward(" 3+4 #### 7", "7") == 1.0
    assert gsm8k_reward("#### 1,000", "1000") == gsm8k_reward("#### 1000.0", "1,000") == 1.0
    assert gsm8k_reward("#### 8", "7") == 0.0
    assert gsm8k_reward("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k_reward("7", "7", format_score=0.1) == 0.0
    assert gsm8k_reward("#### 7", "so 3+4=7\n#### 7") == 1.0


@pytest.mark.parametrize(
    "text, expected",
    [("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"), ("\\boxed{1} and \\fbox{2}", "2"), ("\\boxed 5$", "5"),
     ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"), ("\\boxed{12", None), ("nothing", None)],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "a, b",
    [("\\dfrac{1}{2}", "\\frac12"), ("\\left( 3, 4 \\right)", "(3,4)"), ("10\\text{ cm}", "10"),
     ("\\text{Tuesday}", "Tuesday"), ("90^\\circ", "90"), ("$5$.", "5"), ("1,000", "1000"), ("x = 5", "5"),
     ("\\tfrac{3}{4}", "\\frac{3}{4}"), ("50\\%", "50"), ("2\\!\\sqrt2", "2\\sqrt{2}")],
)
def test_normalize_math_answer_equates_spellings(a, b):
    assert normalize_math_answer(a) == normalize_math_answer(b)


def test_math_reward():
    assert math_reward("so $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}") == 1.0
    assert math_reward("\\boxed{5.0}", "The answer is $\\boxed{5}$.") == 1.0
    assert math_reward("\\boxed{0.5}", "\\frac{1}{2}") == 0.0  # documented: no algebraic equivalence
    assert math_reward("answer 3", "3") == 0.0
    assert math_reward("\\boxed{4}", "3", format_score=0.1) == 0.1


USER_REWARDS = '''
import math

def strict(response, ground_truth):
    if "crash" in response:
        raise RuntimeError("user bug")
    if "text" in response:
        return "yes"
    if "nan" in response:
        return math.nan
    return float(response.strip() == ground_truth)

def with_row(response, ground_truth, row):
    return row["weight"] * float(response == ground_truth)

NOT_CALLABLE = 3

def no_arguments():
    return 1.0
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_load_reward_fn_builtins_modules_and_files(user_file):
    assert load_reward_fn("gsm8k") is gsm8k_reward and load_reward_fn("math") is math_reward
    assert load_reward_fn("scalerl.data.rewards.computer:math_reward") is math_reward
    assert load_reward_fn(f"{user_file}:strict")(" 4", "4") == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [("nope", "not a built-in"), ("", "non-empty"), ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
     ("missing/file.py:f", "does not exist"), ("{file}:absent", "no attribute 'absent'"),
     ("{file}:NOT_CALLABLE", "int, not a function"), ("{file}:no_arguments", "must accept")],
)
def test_load_reward_fn_errors_name_the_spec(user_file, spec, message):
    spec = spec.format(file=user_file)
    with pytest.raises(RewardFunctionError, match=message) as raised:
        load_reward_fn(spec)
    assert repr(spec) in str(raised.value) or spec == ""


def test_file_that_fails_to_import_names_the_file(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency')\n")
    with pytest.raises(RewardFunctionError, match="broken.py failed"):
        load_reward_fn(f"{broken}:f")


def test_reward_computer_scores_failures_zero_counts_and_logs_once(user_file, caplog):
    computer = RewardComputer(f"{user_file}:strict")
    responses = ["4", "crash", "5", "crash again", "text", "nan"]
    rows = [{"ground_truth": "4"}] * len(responses)
    with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
        rewards, failures = computer.compute(responses, rows)
        assert computer.compute(["crash"], rows[:1]) == ([0.0], 1)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and failures == 4
    assert computer.total_failures == 5
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3  # RuntimeError, a str result, a NaN result: each logged once
    assert sum("RuntimeError" in message for message in messages) == 1


def test_reward_computer_passes_row_and_accepts_numpy_like_numbers(user_file):
    rewards, failures = RewardComputer(f"{user_file}:with_row").compute(["a", "b"], [
        {"ground_truth": "a", "weight": 0.5}, {"ground_truth": "a", "weight": 0.5}])
    assert rewards == [0.5, 0.0] and failures == 0
    assert RewardComputer(lambda response, truth: True).compute(["x"], [{"ground_truth": "y"}]) == ([1.0], 0)
    assert RewardComputer(lambda response, truth: math.inf).compute(["x"], [{"ground_truth": "y"}]) == ([0.0], 1)


def test_reward_computer_rejects_mismatched_inputs():
    computer = RewardComputer("gsm8k")
    with pytest.raises(ValueError, match="2 responses but 1 rows"):
        computer.compute(["a", "b"], [{"ground_truth": "1"}])
    with pytest.raises(ValueError, match="no 'ground_truth'"):
        computer.compute(["a"], [{"answer": "1"}])


def test_reward_module_resolves_from_the_current_directory_under_both_entry_points(tmp_path):
    """`scalerl` (a script: sys.path[0] is its folder) and `python -m scalerl` (sys.path[0] is the current
    directory) import `data.reward=module:function` alike: the current directory first, before any other
    folder on the path (here a same-named module on PYTHONPATH), and the module's own imports beside it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    work, elsewhere, bin_dir = tmp_path / "work", tmp_path / "elsewhere", tmp_path / "bin"
    for folder in (work, elsewhere, bin_dir):
        folder.mkdir()
    (work / "helpers.py").write_text("WHERE = 'work'\n")
    (work / "my_reward.py").write_text(
        "import helpers\nprint('reward module from', helpers.WHERE, flush=True)\n"
        "def score(response, truth):\n    return 0.0\n")
    (elsewhere / "my_reward.py").write_text("print('reward module from elsewhere')\ndef score(r, t):\n    return 0.0\n")
    script = bin_dir / "scalerl"  # what `pip install` writes as the console script
    script.write_text("import sys\nfrom scalerl.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{elsewhere}", "OMP_NUM_THREADS": "1"}
    run = ["config", "data.reward=my_reward:score"]  # `config` imports the reward as a run would, and no torch
    for i, entry in enumerate(([sys.executable, str(script)], [sys.executable, "-m", "scalerl"])):
        done = subprocess.run([*entry, *run, f"trainer.output_dir={tmp_path / f'out{i}'}"], cwd=work,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "reward module from work" in done.stdout and "elsewhere" not in done.stdout, entry
