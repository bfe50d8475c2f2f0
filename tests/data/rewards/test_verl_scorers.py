"""verl's default scorers (`data.reward=auto`) score as verl does: `scalerl.data.rewards.verl_scorers` against the
step-by-step transcription of verl's rules in `verl_reward_reference`, on a corpus of tricky responses."""

from __future__ import annotations

import itertools

import pytest

from scalerl.data.rewards import verl_scorers
from scalerl.data.rewards.computer import RewardComputer, default_compute_score
from scalerl.data.rewards.verl_scorers import DATA_SOURCE_CHOICES, UnknownDataSource, gsm8k_answer, gsm8k_score
from tests.data.rewards import verl_reward_reference as verl

GSM8K_RESPONSES = [
    "3 + 4 = 7\n#### 7", "#### 1,000", "#### 1000", "#### $18", "####18", "#### -3", "#### 72.", "#### 7.0",
    "#### 1 then #### 2", "the answer is 42", "no digits here", "", "#### .", "...", "a, b, c", "1,2,3.",
    "#### 5" + " filler" * 80, "#### 9\n" + "x" * 400, "x" * 400 + "#### 9", "#### 3.5 dollars", "#### --4",
    "Answer: 12, so #### 12,", "-.5 is #### -.5", "#### 1e3", "#### ,", "12. 13. .",
]
GSM8K_TRUTHS = ["7", "1000", "18", "-3", "72", "12", "9", "-.5", "42", "3", ","]

MATH_RESPONSES = [
    "so $x = \\boxed{\\frac{1}{2}}$.", "\\boxed{1} then \\boxed{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\boxed{0.5}",
    "\\boxed{\\dfrac12}", "\\boxed{\\tfrac{1}{2}}", "\\boxed{1/2}", "\\boxed 5$ and more", "\\boxed 5",
    "\\boxed{5} and \\boxed 7$", "\\fbox{5}", "\\boxed{12", "nothing boxed", "\\boxed{10\\text{ cm}}",
    "\\boxed{10 \\text{ cm} \\text{ m}}", "\\boxed{90^\\circ}", "\\boxed{90^{\\circ}}", "\\boxed{50\\%}",
    "\\boxed{\\$5}", "\\boxed{x = 5}", "\\boxed{k=5}", "\\boxed{y = 2x+1}", "\\boxed{\\left( 3, 4 \\right)}",
    "\\boxed{.5}", "\\boxed{ .5}", "\\boxed{\\sqrt2}", "\\boxed{2\\sqrt3}", "\\boxed{\\sqrt}", "\\boxed{\\frac}",
    "\\boxed{\\frac1}", "\\boxed{\\frac{1}2}", "\\boxed{\\frac1{2}}", "\\boxed{\\frac\\frac{1}{2}{3}}",
    "\\boxed{\\{1,2\\}}", "\\boxed{3.}", "\\boxed{}", "\\boxed\\frac12", "\\boxed}{5}", "\\boxed{a\\\\b}",
    "\\boxed{1,000}", "\\boxed{\\text{Tuesday}}", "\\boxed{\n5\n}", "\\boxed{\\!5}", "\\boxed{+3/4}",
    "\\boxed{3/4}", "\\boxed{-3/4}", "\\boxed{1/2/3}", "\\boxed{\\frac{1}{2}}.", "$\\boxed{5}$ dollars",
]
MATH_TRUTHS = ["\\frac{1}{2}", "2", "5", "10", "90", "50", "(3,4)", "0.5", "\\sqrt{2}", "2\\sqrt{3}", "y = 2x+1",
               "\\{1,2\\}", "3", "1000", "Tuesday", "\\frac34", "-\\frac{3}{4}", "", "\\text{ cm} \\text{ m}", "7"]

DAPO_RESPONSES = [
    "Answer: 5", "answer: 5", "ANSWER:5", "The answer: $\\boxed{5}$", "Answer: \\boxed{5}", "Answer: 5 dollars",
    "Answer: x = 5", "Answer: 1,000", "Answer: 1,000,000 units", "Answer: \\frac12", "Answer: \\frac{1}{2}",
    "Answer: \\sqrt3", "Answer: $5$ and $6$", "Answer: \\text{(A)}", "Answer: 5.", "Answer: a 5",
    "Answer: an apple", "Answer: 90^\\circ", "Answer: 4\nAnswer: 7", "Answer: 4\nsome more text", "no answer line",
    "x" * 400 + "Answer: 9", "Answer: 9" + "x" * 400, "Answer: 3 \\text{ cm}", "Answer: \\overline{12}",
    "Answer: 5\\;", "Answer: {,}5", "Answer: \\textbf{7}", "Answer: 2 hours and 3 minutes", "Answer:",
]
DAPO_TRUTHS = ["5", "1000", "\\frac{1}{2}", "\\sqrt{3}", "(A)", "7", "9", "12", "4", "3", "1000000", "90",
               "$5$", "\\boxed{5}"]

CASES = (
    [("openai/gsm8k", r, t) for r, t in itertools.product(GSM8K_RESPONSES, GSM8K_TRUTHS)]
    + [(source, r, t) for source in verl_scorers.MATH_SOURCES for r, t in itertools.product(MATH_RESPONSES, MATH_TRUTHS)]
    + [(source, r, t) for source in ("math_dapo", "math", "aime2024", "aime25")
       for r, t in itertools.product(DAPO_RESPONSES, DAPO_TRUTHS)]
)


def test_default_compute_score_equals_verl_on_the_corpus():
    different = [(s, r, t, ours, theirs) for s, r, t in CASES
                 if (ours := default_compute_score(s, r, t)) != (theirs := verl.default_compute_score(s, r, t))]
    assert not different, different[:5]
    # The corpus exercises both outcomes of every family (a corpus that always scores 0 would prove nothing).
    for sources in (verl_scorers.GSM8K_SOURCES, verl_scorers.MATH_SOURCES, ("math_dapo",)):
        scores = {_score(default_compute_score(s, r, t)) for s, r, t in CASES if s == sources[0]}
        assert len(scores) == 2, (sources, scores)


def _score(result):
    return result["score"] if isinstance(result, dict) else result


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_gsm8k_extraction_both_methods_equal_verl(method):
    for response, truth in itertools.product(GSM8K_RESPONSES, GSM8K_TRUTHS):
        assert gsm8k_answer(response, method) == verl.gsm8k_extract_solution(response, method), response
        assert gsm8k_score(response, truth, method, format_score=0.1) == verl.gsm8k_compute_score(
            response, truth, method, format_score=0.1), (response, truth)


@pytest.mark.parametrize("source, response, truth, expected", [
    ("openai/gsm8k", "#### 1,000", "1000", 1.0),  # commas are dropped before comparing
    ("openai/gsm8k", "#### 72.", "72", 0.0),  # but the comparison is textual: verl's quirk, kept
    ("openai/gsm8k", "#### 7.0", "7", 0.0),
    ("HuggingFaceH4/MATH-500", "so $\\boxed{\\dfrac12}$.", "\\frac{1}{2}", 1.0),
    ("HuggingFaceH4/MATH-500", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # Hendrycks' "0.5" rule
    ("lighteval/MATH", "\\fbox{5}", "5", 0.0),  # found, but verl's remove_boxed rejects \fbox
    ("lighteval/MATH", "\\boxed{5} and \\boxed 7$", "7", 1.0),  # a "\boxed " anywhere wins over later braces
    ("math_dapo", "Answer: 5", "5", {"score": 1.0, "acc": True, "pred": "5"}),
    ("aime2024", "so 5", "5", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
])
def test_documented_examples(source, response, truth, expected):
    assert default_compute_score(source, response, truth) == expected


def test_unknown_data_source_names_it_and_the_choices():
    with pytest.raises(UnknownDataSource, match="'my/dataset'") as raised:
        default_compute_score("my/dataset", "x", "1")
    assert all(choice in str(raised.value) for choice in DATA_SOURCE_CHOICES)
    # Through data.reward=auto, before any call, for the first row that names it.
    computer = RewardComputer("auto")
    with pytest.raises(UnknownDataSource, match="'numina_olympiads'.*verl also scores numina_"):
        computer.compute(["x", "y"], [{"ground_truth": "1", "data_source": "openai/gsm8k"},
                                      {"ground_truth": "1", "data_source": "numina_olympiads"}])


def test_auto_scores_by_data_source_and_falls_back_to_the_task_reward():
    computer = RewardComputer("auto", task="math")
    rows = [{"ground_truth": "7", "data_source": "openai/gsm8k"},
            {"ground_truth": "5", "data_source": "math_dapo"},
            {"ground_truth": "\\frac{1}{2}"},  # no data_source: the math task's own reward
            {"reward_model": {"ground_truth": "3"}, "data_source": "lighteval/MATH"}]  # verl's raw layout
    responses = ["#### 7", "Answer: 4", "\\boxed{\\dfrac{1}{2}}", "\\boxed{3}"]
    assert computer.compute(responses, rows) == ([1.0, -1.0, 1.0, 1.0], 0)
    assert computer.last_metrics == {"reward/extra/acc": 0.0}  # math_dapo's acc; its text "pred" is no metric
