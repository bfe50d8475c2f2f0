"""Backends for hosted tracking services (Weights & Biases, MLflow), used only when installed and asked for."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from scalerl.tracking.backend import numeric_metrics

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
