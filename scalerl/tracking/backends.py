"""Where per-step metrics go: what every backend implements and the value conversions they share
(`MetricsBackend`), `metrics.jsonl` (one JSON object per line, flushed every step), TensorBoard event files
under ``output_dir/tensorboard``, and the hosted tracking services (Weights & Biases, MLflow), used only when
installed and asked for. The console's rich table is `console_backend`."""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
from pathlib import Path
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


METRICS_FILE_NAME = "metrics.jsonl"


def _is_json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All well-formed step records of a metrics file; a torn last line (a crash mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


class JsonlBackend:
    """Appends ``{"step": n, **metrics}`` lines to ``output_dir/metrics.jsonl``.

    An existing file is appended to, so a resumed run continues its history; ``truncate_after`` first
    drops the lines the resumed run will write again. Values JSON cannot hold are left out; NaN and
    infinity are written as the bare ``NaN`` / ``Infinity`` that Python's and pandas' readers accept.
    """

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / METRICS_FILE_NAME
        self._file = None

    def truncate_after(self, step: int) -> None:
        """Keep only the lines with ``step <= step`` (and drop torn ones), rewriting the file atomically."""
        self._close_file()
        if not self.path.exists():
            return
        kept = [record for record in read_metrics_jsonl(self.path) if record["step"] <= step]
        tmp_path = self.path.with_suffix(".jsonl.tmp")
        with open(tmp_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in kept)
        os.replace(tmp_path, self.path)

    def _open_file(self):
        if self._file is None:
            ends_mid_line = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
            self._file = open(self.path, "a", encoding="utf-8")
            if ends_mid_line:  # a torn line from a crash: end it so the next record starts cleanly
                self._file.write("\n")
        return self._file

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step}
        record.update({k: v for k, v in metrics.items() if k != "step" and _is_json_value(v)})
        f = self._open_file()
        f.write(json.dumps(record) + "\n")
        f.flush()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()


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


DEFAULT_PROJECT = "scalerl"
# MLflow rejects parameter values longer than this (500 on older servers).
MLFLOW_PARAM_VALUE_LIMIT = 500


def import_backend_package(backend: str, package: str) -> Any:
    """Import ``package`` or fail with the pip command that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise ImportError(
            f"the {backend!r} metrics backend needs the {package!r} package, which is not installed: "
            f"pip install {package}"
        ) from error


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, for services that take flat parameters."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


class WandbBackend:
    """Logs to a W&B run; the project comes from ``WANDB_PROJECT`` (default ``scalerl``)."""

    def __init__(self, output_dir: str | Path, run_name: str | None, config: dict[str, Any] | None):
        self._wandb = import_backend_package("wandb", "wandb")
        self._run = self._wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=run_name,
            config=config,
            dir=str(output_dir),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(numeric_metrics(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowBackend:
    """Logs to an MLflow run; the store is ``MLFLOW_TRACKING_URI`` or ``output_dir/mlruns``."""

    def __init__(self, output_dir: str | Path, run_name: str | None, config: dict[str, Any] | None):
        self._mlflow = import_backend_package("mlflow", "mlflow")
        if "MLFLOW_TRACKING_URI" not in os.environ:
            self._mlflow.set_tracking_uri((Path(output_dir).resolve() / "mlruns").as_uri())
        self._mlflow.start_run(run_name=run_name)
        if config:
            params = {key: str(value)[:MLFLOW_PARAM_VALUE_LIMIT] for key, value in flatten_config(config).items()}
            self._mlflow.log_params(params)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._mlflow.log_metrics(numeric_metrics(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()
