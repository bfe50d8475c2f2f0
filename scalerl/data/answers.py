"""Final-answer extraction and normalization for GSM8K-style (`#### 72`) and MATH-style (`\\boxed{...}`) text.

The reward functions and the file loaders share these, so a ground truth read from a file and an
answer read from a model response go through the same code.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# "#### 1,234.5", "####-3", "#### $18": sign, digits with thousands commas, optional decimals.
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_TEXT_COMMAND = r"\\(?:text|textbf|textrm|mbox|mathrm)\s*\{([^{}]*)\}"
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def extract_hash_answer(text: str) -> str | None:
    """The number after the last `####` in `text`, with thousands commas removed; None when there is none.

    >>> extract_hash_answer("She has 3 + 4 = 7 apples.\\n#### 1,007")
    '1007'
    """
    matches = _HASH_ANSWER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`; None when absent.

    Braces are matched, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. If the last box is never closed
    (a truncated generation) the answer is None: an earlier box is not the final answer.

    >>> extract_boxed("so $x = \\\\boxed{\\\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    """
    start, command = max((text.rfind(command), command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    body = rest.lstrip()
    if body.startswith("{"):
        depth = 0
        for position, character in enumerate(body):
            if character == "{":
                depth += 1
            elif character == "}":
                depth -= 1
                if depth == 0:
                    return body[1:position]
        return None
    if rest[:1].isspace() and body:  # "\boxed 5$" (seen in MATH solutions)
        return re.split(r"[\s$]", body, maxsplit=1)[0]
    return None


def normalize_math_answer(answer: str) -> str:
    """A light canonical form of a MATH answer, so that trivially different spellings compare equal.

    Removes spaces and LaTeX spacing (`\\!`, `\\,`, `\\;`), `\\left`/`\\right`, dollar signs, a trailing
    period, degrees (`^\\circ`) and percent signs, and units written as `\\text{...}` after a value (a
    whole answer like `\\text{Tuesday}` is unwrapped instead); turns `\\dfrac`/`\\tfrac` into `\\frac`,
    `\\frac12` into `\\frac{1}{2}`, `\\sqrt2` into `\\sqrt{2}`, `x=5` into `5` and `1,000` into `1000`.
    Deliberately not done: algebraic equivalence, so `0.5` and `\\frac{1}{2}` stay different answers.
    """
    text = answer.strip()
    whole_text = re.fullmatch(_TEXT_COMMAND, text)
    if whole_text:
        text = whole_text.group(1)
    text = re.sub(_TEXT_COMMAND + r"(\^\{?\d\}?)?", "", text)  # units such as "5 \text{cm}^2"
    for pattern, replacement in (
        (r"\\[dt]frac", r"\\frac"),
        (r"\\left|\\right", ""),
        (r"\\[!,;:]|\\quad|\\?\$", ""),
        (r"\^\s*\{?\\circ\}?|\\%|%", ""),
        (r"\s+", ""),
        (r"\\frac(\d)(\d)", r"\\frac{\1}{\2}"),
        (r"\\sqrt(\d)", r"\\sqrt{\1}"),
    ):
        text = re.sub(pattern, replacement, text)
    text = text.rstrip(".")
    # "x=5" -> "5" when the left side is a short variable name, as Hendrycks' MATH normalization does;
    # answers and ground truths both pass through here, so "y=2x+1" still matches "y = 2x + 1".
    if text.count("=") == 1 and len(text.split("=")[0]) <= 2 and text.split("=")[0].isalpha():
        text = text.split("=")[1]
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return text


def same_number(a: str, b: str) -> bool | None:
    """Whether two numeric strings are the same number (`5` == `5.00`); None when either is not a number."""
    try:
        return Decimal(a.replace(",", "")) == Decimal(b.replace(",", ""))
    except InvalidOperation:
        return None
