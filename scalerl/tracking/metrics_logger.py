"""``MetricsLogger``: one call per training step fans the step's metrics out to the chosen backends."""

from __future__ import annotations

import dataclasses
import enum
import warnings
from pathlib import Path
from typing import Any, Iterable

import yaml

from scalerl.tracking.backends import (
    JsonlBackend,
    MetricsBackend,
    MlflowBackend,
    TensorBoardBackend,
    WandbBackend,
    to_python_scalar,
)
from scalerl.tracking.console_backend import ConsoleBackend

VALID_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
DEFAULT_BACKENDS = ("console", "jsonl", "tensorboard")
CONFIG_FILE_NAME = "config.yaml"


def parse_backend_names(backends: str | Iterable[str]) -> list[str]:
    """Backend names from a list or a comma-separated string, deduplicated, checked against the valid ones."""
    names = backends.split(",") if isinstance(backends, str) else list(backends)
    names = list(dict.fromkeys(name.strip() for name in names if name.strip()))
    unknown = [name for name in names if name not in VALID_BACKENDS]
    if unknown:
        raise ValueError(f"unknown metrics backend(s) {unknown}; valid backends are {list(VALID_BACKENDS)}")
    return names


def yaml_safe(value: Any) -> Any:
    """Turn dataclasses, tuples, paths and enums into the plain types ``yaml.safe_dump`` accepts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(key): yaml_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [yaml_safe(item) for item in value]
    if isinstance(value, enum.Enum):
        return yaml_safe(value.value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class MetricsLogger:
    """Writes each step's metrics to the console, ``metrics.jsonl``, TensorBoard, W&B or MLflow.

    ``backends=None`` means console + jsonl + tensorboard, with tensorboard skipped (and a warning) when
    the package is missing; a backend named explicitly must be installed. ``resume_step`` is the first
    step a resumed run will log: earlier jsonl lines are kept, later ones dropped, and TensorBoard purges
    from there. ``config``, when given, is written as ``output_dir/config.yaml``. Only one process of a
    distributed run (rank 0) should log.
    """

    def __init__(
        self,
        output_dir: str | Path,
        backends: str | Iterable[str] | None = None,
        total_steps: int | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        resume_step: int | None = None,
        console_mode: str = "auto",
    ):
        self.output_dir = Path(output_dir)
        names = parse_backend_names(DEFAULT_BACKENDS if backends is None else backends)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name or self.output_dir.resolve().name
        if config is not None:
            with open(self.output_dir / CONFIG_FILE_NAME, "w", encoding="utf-8") as f:
                yaml.safe_dump(yaml_safe(config), f, sort_keys=False)
        self.backends: dict[str, MetricsBackend] = {}
        try:
            for name in names:
                backend = self._make_backend(name, total_steps, config, resume_step, console_mode, backends is None)
                if backend is not None:
                    self.backends[name] = backend
        except BaseException:
            self.close()
            raise
        self._closed = False

    def _make_backend(self, name, total_steps, config, resume_step, console_mode, is_default):
        if name == "console":
            return ConsoleBackend(total_steps=total_steps, mode=console_mode)
        if name == "jsonl":
            backend = JsonlBackend(self.output_dir)
            if resume_step is not None:
                backend.truncate_after(resume_step - 1)
            return backend
        if name == "tensorboard":
            try:
                return TensorBoardBackend(self.output_dir, resume_step=resume_step)
            except ImportError as error:
                if not is_default:
                    raise
                warnings.warn(f"{error}; continuing without it", stacklevel=3)
                return None
        if name == "wandb":
            return WandbBackend(self.output_dir, self.run_name, yaml_safe(config) if config else None)
        return MlflowBackend(self.output_dir, self.run_name, yaml_safe(config) if config else None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's metrics; tensors and numpy scalars are unwrapped to Python numbers."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        plain = {key: to_python_scalar(value) for key, value in metrics.items()}
        for backend in self.backends.values():
            backend.log(plain, step)

    def truncate_after(self, step: int) -> None:
        """Drop jsonl lines logged after ``step`` (for a run resumed from a checkpoint taken at ``step``)."""
        if "jsonl" in self.backends:
            self.backends["jsonl"].truncate_after(step)

    def close(self) -> None:
        """Flush and close every backend; safe to call twice."""
        for backend in getattr(self, "backends", {}).values():
            backend.close()
        self.backends = {}
        self._closed = True

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
