"""A PNG of reward and accuracy per step, drawn from a ``metrics.jsonl`` file without any display."""

from __future__ import annotations

import numbers
from pathlib import Path

from scalerl.tracking.backends import read_metrics_jsonl

DEFAULT_PLOT_KEYS = ("critic/score/mean", "val/accuracy")


def plot_metrics(
    jsonl_path: str | Path,
    png_path: str | Path,
    keys: tuple[str, ...] = DEFAULT_PLOT_KEYS,
    title: str | None = None,
) -> Path:
    """Draw one subplot per key of ``keys`` present in ``jsonl_path`` (value against step); returns ``png_path``.

    Keys no step carries are skipped; if none is present a ``ValueError`` lists the keys the file has.
    """
    try:
        from matplotlib.figure import (
            Figure,  # no pyplot: no GUI backend, no global figure state
        )
    except ImportError as error:
        raise ImportError("plot_metrics needs the 'matplotlib' package: pip install matplotlib") from error

    records = read_metrics_jsonl(jsonl_path)
    series = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), numbers.Real)]
        if points:
            series[key] = points
    if not series:
        available = sorted({key for record in records for key in record} - {"step"})
        raise ValueError(
            f"none of the keys {list(keys)} appear in {jsonl_path}; it has {available[:20]}"
            + (" ..." if len(available) > 20 else "")
        )

    figure = Figure(figsize=(7, 2.6 * len(series)), layout="constrained")
    axes = figure.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, points) in zip(axes, series.items()):
        steps, values = zip(*sorted(points))
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        figure.suptitle(title)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, format="png", dpi=100)
    return png_path
