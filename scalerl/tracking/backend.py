"""What every metrics backend implements, and the value conversions they share."""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol


class MetricsBackend(Protocol):
    """One destination for per-step metrics (console, a file, a tracking service)."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def to_python_scalar(value: Any) -> Any:
    """Unwrap one-element tensors and numpy scalars (anything with ``.item()``) into Python numbers."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):  # more than one element: leave as is
            return value
    return value


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are real numbers (bools count as 0/1), as floats; strings and lists are dropped."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, numbers.Real) and not isinstance(value, complex)
    }


def format_metric_value(value: Any) -> str:
    """Short human form: 4 significant digits for floats, everything else as ``str``."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)
