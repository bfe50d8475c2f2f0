"""Numbers in a config: the bounds a field declares (`opt(..., above=0)`) and the generic check of every
number against them (finite, within bounds), with messages that name the dotted key.

Done once here for every section, so none can forget a check. Finiteness comes first: `nan` fails every
comparison, so a hand-written `if value < 0` lets it through, and `inf` passes most bounds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

BOUND_NAMES = ("at_least", "above", "at_most", "below")


def opt(default: Any = dataclasses.MISSING, help: str = "", factory: Any = dataclasses.MISSING, *,
        at_least: float | None = None, above: float | None = None, at_most: float | None = None,
        below: float | None = None) -> Any:
    """A dataclass field with a one-line help text (shown by `scalerl config --keys`) and, for numbers, the
    bounds every value (each item of a list) must keep: `at_least` <= v, `above` < v, v <= `at_most`,
    v < `below`. Checked generically by `Section.validate`, with the dotted key in the message."""
    bounds = {k: v for k, v in zip(BOUND_NAMES, (at_least, above, at_most, below)) if v is not None}
    return field(default=default, default_factory=factory, metadata={"help": help, "bounds": bounds})


def describe_bounds(bounds: dict[str, float]) -> str:
    """`{"above": 0, "at_most": 1}` -> "in (0, 1]"; one-sided bounds -> "> 0", ">= 1"."""
    low = ("[", bounds["at_least"]) if "at_least" in bounds else ("(", bounds["above"]) if "above" in bounds else None
    high = ("]", bounds["at_most"]) if "at_most" in bounds else (")", bounds["below"]) if "below" in bounds else None
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return "any finite number"


def _within(value: float, bounds: dict[str, float]) -> bool:
    return (value >= bounds.get("at_least", -math.inf) and value > bounds.get("above", -math.inf)
            and value <= bounds.get("at_most", math.inf) and value < bounds.get("below", math.inf))


def number_problems(key: str, value: Any, bounds: dict[str, float]) -> list[str]:
    """Why `value` (a number, or each number of a list) is not a finite number within `bounds`."""
    problems = []
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue
        name = key + (f"[{i}]" if isinstance(value, list) else "")
        if not math.isfinite(item):
            problems.append(f"{name} must be a finite number, got {item}")
        elif bounds and not _within(item, bounds):
            problems.append(f"{name} must be {describe_bounds(bounds)}, got {item!r}")
    return problems
