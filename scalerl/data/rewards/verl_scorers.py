"""verl's default scorers, chosen by a row's `data_source` (`data.reward=auto`), scoring as verl does.

`default_compute_score(data_source, solution_str, ground_truth, extra_info=None)` gives the score verl's
`verl.utils.reward_score.default_compute_score` gives on the same strings (checked against a step-by-step
transcription of verl's rules, commit b178a3c, in tests/data/rewards/verl_reward_reference.py):

    openai/gsm8k                            the last `#### <number>` in the last 300 characters, equal to
                                            the ground truth as text ("1,000" -> "1000"; "72." != "72"): 1 or 0
    lighteval/MATH, HuggingFaceH4/MATH-500, the last `\\boxed{...}` (a `\\boxed ` with a space anywhere wins),
    DigitalLearningGmbH/MATH-lighteval      compared after Hendrycks' normalisation: 1 or 0
    math_dapo, math, math_dapo_reasoning,   the last "Answer: ..." line in the last 300 characters, compared
    aime*                                   after Minerva's normalisation: {"score": 1 or -1, "acc", "pred"}

These are deliberately verl's quirks, not scalerl's own `gsm8k`/`math` rewards (`scalerl.data.answers`,
which compare numbers by value and accept `\\fbox`): a run moved from verl keeps its reward curve.
"""

from __future__ import annotations

import re
from typing import Any

from scalerl.data.rewards.functions import RewardFunctionError

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_PREFIX = "aime"
# verl scores these with modules scalerl does not carry (prime_math, code sandboxes, geo3k, search-R1 EM).
VERL_ONLY_SOURCES = ("numina_*", "codecontests", "apps", "codeforces", "taco", "hiyouga/geometry3k", "searchR1_*")
DATA_SOURCE_CHOICES = (*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, DAPO_PREFIX + "*")

_TAIL_CHARS = 300  # verl reads only the end of a response: the final answer is there


class UnknownDataSource(RewardFunctionError):
    """A `data_source` with no default scorer; the message names it and the choices."""


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None) -> float | dict[str, Any]:
    """verl's score of `solution_str` for a row of `data_source`: a float, or a dict with "score" (math_dapo)."""
    if data_source in GSM8K_SOURCES:
        return float(gsm8k_score(solution_str, ground_truth))
    if data_source in MATH_SOURCES:
        return hendrycks_math_score(solution_str, ground_truth)
    if data_source in DAPO_SOURCES or (isinstance(data_source, str) and data_source.startswith(DAPO_PREFIX)):
        return minerva_answer_score(solution_str, ground_truth)
    raise UnknownDataSource(unknown_data_source_message(data_source))


def is_known_data_source(data_source: Any) -> bool:
    return isinstance(data_source, str) and (
        data_source in GSM8K_SOURCES + MATH_SOURCES + DAPO_SOURCES or data_source.startswith(DAPO_PREFIX))


def unknown_data_source_message(data_source: Any) -> str:
    return (f"data.reward=auto has no default scorer for data_source {data_source!r}; the choices are "
            f"{', '.join(DATA_SOURCE_CHOICES)} (verl also scores {', '.join(VERL_ONLY_SOURCES)} with code scalerl "
            "does not include); for other sources give data.reward=path/to/file.py:compute_score")


# ------------------------------------------------------------------------------------------------- GSM8K

_STRICT_GSM8K = re.compile(r"#### (-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"(-?[0-9.,]+)")


def gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """verl's GSM8K answer: "strict" = the last `#### <number>` (commas removed); "flexible" = the last run
    of digits, dots and commas that is not a lone "." (commas kept). Only the last 300 characters count."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = text[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT_GSM8K.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _ANY_NUMBER.findall(tail)
    if not found:
        return None
    usable = [number for number in found if number != "."]
    return usable[-1] if usable else found[0]  # verl's loop ends on the first match when none is usable


def gsm8k_score(text: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """`score` when verl's GSM8K answer equals `ground_truth` exactly, `format_score` when it differs, 0 when absent."""
    answer = gsm8k_answer(text, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


# -------------------------------------------------------------------------------------------- MATH (Hendrycks)


def last_boxed(text: str) -> str | None:
    """The last box as verl's MATH scorer finds it, command included: `\\boxed ` + the text up to a `$` when a
    `\\boxed ` (with a space) occurs anywhere; else the last `\\boxed` (or, with none, `\\fbox`) up to the
    brace that closes its first `{`. None when there is no box or it never closes."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def hendrycks_math_score(text: str, ground_truth: Any) -> float:
    """1.0 when the last box of `text` equals `ground_truth` after Hendrycks' normalisation (verl's
    math_reward), else 0.0. A `\\fbox{}` answer, found but not unwrapped by verl, scores 0."""
    box = last_boxed(text)
    if box is None:
        return 0.0
    if box.startswith("\\boxed "):
        answer = box[len("\\boxed "):]
    elif box.startswith("\\boxed{") and box.endswith("}"):
        answer = box[len("\\boxed{"):-1]
    else:
        return 0.0
    return 1.0 if _same_hendrycks_answer(answer, ground_truth) else 0.0


def _same_hendrycks_answer(answer: str, ground_truth: Any) -> bool:
    if ground_truth is None:
        return False
    left, right = hendrycks_normal_form(answer), hendrycks_normal_form(ground_truth)
    if left is None or right is None:  # where the normalisation cannot run, verl compares the raw texts
        return answer == ground_truth
    return left == right


def hendrycks_normal_form(answer: Any) -> str | None:
    """Hendrycks' MATH normalisation as verl applies it; None where verl's raises (a non-string, two
    `\\text{ ` units, a `\\sqrt` or `\\frac` with nothing after it)."""
    if not isinstance(answer, str):
        return None
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    units = text.split("\\text{ ")
    if len(units) > 2:
        return None
    text = units[0]
    text = text.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        text = sides[1]
    text = _braced_after(text, "\\sqrt", both=False)
    if text is None:
        return None
    text = _braced_after(text.replace(" ", ""), "\\frac", both=True)
    if text is None:
        return None
    if text == "0.5":
        return "\\frac{1}{2}"
    return _slash_as_frac(text)


def _braced_after(text: str, command: str, both: bool) -> str | None:
    """`\\sqrt3` -> `\\sqrt{3}`; with `both`, `\\frac12` -> `\\frac{1}{2}` and `\\frac1{2}` -> `\\frac{1}{2}`.
    None when a command has nothing after it; the text unchanged when a `\\frac` has one character only."""
    pieces = text.split(command)
    if len(pieces) == 1:
        return text
    out = pieces[0]
    for piece in pieces[1:]:
        if not piece:
            return None
        if piece[0] == "{":
            out += command + piece
        elif not both:
            out += command + "{" + piece[0] + "}" + piece[1:]
        elif len(piece) < 2:
            return text
        elif piece[1] == "{":
            out += command + "{" + piece[0] + "}" + piece[1:]
        else:
            out += command + "{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return out


def _slash_as_frac(text: str) -> str:
    """"3/4" -> "\\frac{3}{4}" when both sides are integers written plainly."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return f"\\frac{{{numerator}}}{{{denominator}}}"


# ------------------------------------------------------------------------------------- math_dapo (Minerva)

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Applied in order, as plain text replacements: first these pairs, then these removals.
_MINERVA_REPLACEMENTS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                         ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVALS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_MINERVA_PATTERNS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # the first $...$ span only
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def minerva_normal_form(answer: str) -> str:
    """Minerva's final-answer normalisation (verl's math_dapo): the right of the last "=", units and filler
    words removed, `\\text{}`/`\\boxed{}` unwrapped, `\\frac12` braced, "1,000" -> "1000"."""
    text = answer.split("=")[-1]
    for before, after in _MINERVA_REPLACEMENTS:
        text = text.replace(before, after)
    for removed in _MINERVA_REMOVALS:
        text = text.replace(removed, "")
    for pattern, replacement in _MINERVA_PATTERNS:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def minerva_answer_score(text: str, ground_truth: str) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": the normalised answer}: the last "Answer: ..." line of the
    last 300 characters against `ground_truth`, both normalised ("[INVALID]" when there is no such line)."""
    found = _ANSWER_LINE.findall(text[-_TAIL_CHARS:])
    prediction = minerva_normal_form(found[-1] if found else "[INVALID]")
    correct = prediction == minerva_normal_form(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction}
