"""Per-step metrics on the console: a rich progress bar on a terminal, one plain line per step otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

from scalerl.tracking.backends import format_metric_value

logger = logging.getLogger("scalerl.tracking")

# Shown on the console, in this order, when present; every metric goes to the debug log.
KEY_METRICS = (
    "critic/score/mean",
    "sft/loss",
    "val/accuracy",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "perf/throughput",
    "perf/mfu",
    "timing_s/step",
)
# When a step has none of the key metrics, show this many of its own so the line is never empty.
FALLBACK_METRIC_COUNT = 6


def key_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The console-worthy subset of ``metrics``."""
    chosen = {key: metrics[key] for key in KEY_METRICS if key in metrics}
    return chosen or dict(list(metrics.items())[:FALLBACK_METRIC_COUNT])


def format_metrics(metrics: dict[str, Any], separator: str = " | ") -> str:
    return separator.join(f"{key}={format_metric_value(value)}" for key, value in metrics.items())


class ConsoleBackend:
    """Writes key metrics to stdout.

    ``mode="auto"`` picks a rich progress bar when stdout is a terminal and plain lines
    (``step 3/20 | critic/score/mean=0.41 | timing_s/step=1.2``) otherwise, so CI logs stay readable.
    The bar's position is the logged step, read as the number of steps done out of ``total_steps``.
    """

    def __init__(self, total_steps: int | None = None, mode: str = "auto", console: Any = None):
        if mode not in ("auto", "progress", "plain"):
            raise ValueError(f"console mode must be 'auto', 'progress' or 'plain', got {mode!r}")
        if mode == "auto":
            mode = "progress" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.total_steps = total_steps
        self._console = console
        self._progress = None
        self._task = None

    def _plain_line_due(self, metrics: dict[str, Any], step: int) -> bool:
        """About 20 lines per run in logs: every `total_steps // 20`-th step, the first and last steps, and
        any step with evaluation results (all steps still go to the debug log and the other backends)."""
        if self.total_steps is None or self.total_steps <= 40:
            return True
        every = self.total_steps // 20
        return step <= 1 or step >= self.total_steps or step % every == 0 or any(k.startswith("val/") for k in metrics)

    def _step_label(self, step: int) -> str:
        return f"step {step}/{self.total_steps}" if self.total_steps is not None else f"step {step}"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        logger.debug("%s | %s", self._step_label(step), format_metrics(metrics))
        shown = format_metrics(key_metrics(metrics))
        if self.mode == "plain":
            if not self._plain_line_due(metrics, step):
                return
            # sys.stdout looked up per call so redirection (pytest capture, contextlib) is honoured.
            print(f"{self._step_label(step)} | {shown}" if shown else self._step_label(step), flush=True)
            return
        self._start_progress_bar()
        self._progress.update(self._task, completed=step, description=shown.replace(" | ", "  "))

    def _start_progress_bar(self) -> None:
        if self._progress is not None:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=self._console,
        )
        self._task = self._progress.add_task("", total=self.total_steps)
        self._progress.start()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
