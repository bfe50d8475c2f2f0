"""How findings are worded: a `Finding` built from a rule's data (its leaf, and its fix only when there is
something to fix), and measured numbers as text (rank ranges, rates, sizes)."""

from __future__ import annotations

from typing import Any

from scalerl.health.thresholds import RULES
from scalerl.health.tree import FAULT, WARNING, Finding


def finding(rule_id: str, status: str, summary: str, evidence: dict | None = None, fix: str = "",
            ranks=(), hosts=()) -> Finding:
    """A finding of rule ``rule_id`` on its leaf; ranks and hosts deduplicated, in order."""
    return Finding(RULES[rule_id].leaf, rule_id, status, summary, evidence or {},
                   fix if status in (WARNING, FAULT) else "", tuple(sorted(set(ranks))), tuple(dict.fromkeys(hosts)))


def fix_text(rule_id: str, **values: Any) -> str:
    """The rule's fix template filled in with what it measured."""
    return RULES[rule_id].fix.format(**values)


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        start = rank if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def size_text(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n < 2**30 else f"{n / 2**30:g} GiB"


def ratio_text(x: float) -> str:
    return f"{x:.0%}" if x < 10 else f"{x:.1f}x"
