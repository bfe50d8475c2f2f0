"""Progress over the matrix: a rich progress bar on a terminal, one plain line per event otherwise (logs, CI)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

if TYPE_CHECKING:
    from typing import Self


class BenchProgress:
    def __init__(self, total: int, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.total, self.done = total, 0
        self._progress: Progress | None = None
        if self.interactive:
            self._progress = Progress(TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"),
                                      console=Console(file=self.stream), transient=False)
            self._task = self._progress.add_task("", total=total)

    def __enter__(self) -> Self:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def log(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def start(self, label: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=label)
        else:
            self.log(f"[{self.done + 1}/{self.total}] {label} ...")

    def advance(self, line: str) -> None:
        self.done += 1
        if self._progress is not None:
            self._progress.update(self._task, advance=1)
        self.log(f"  {line}")
