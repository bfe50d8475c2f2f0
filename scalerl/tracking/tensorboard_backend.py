"""Per-step scalars written as TensorBoard event files under ``output_dir/tensorboard``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalerl.tracking.backend import numeric_metrics


class TensorBoardBackend:
    """One scalar series per numeric metric; other values are skipped.

    ``resume_step`` is passed to ``SummaryWriter(purge_step=...)`` so a resumed run hides the events
    an earlier attempt wrote from that step on.
    """

    def __init__(self, output_dir: str | Path, resume_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "the 'tensorboard' metrics backend needs the 'tensorboard' package: pip install tensorboard"
            ) from error
        self.log_dir = Path(output_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_step)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in numeric_metrics(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()  # a step takes seconds; losing none to a crash is worth one flush

    def close(self) -> None:
        self._writer.close()
