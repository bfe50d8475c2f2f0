"""Metrics output: per-step logging to console / jsonl / TensorBoard / W&B / MLflow, and metric plots."""

from scalerl.tracking.backends import (
    JsonlBackend,
    MetricsBackend,
    MlflowBackend,
    TensorBoardBackend,
    WandbBackend,
    read_metrics_jsonl,
)
from scalerl.tracking.console_backend import KEY_METRICS, ConsoleBackend
from scalerl.tracking.metrics_logger import (
    DEFAULT_BACKENDS,
    VALID_BACKENDS,
    MetricsLogger,
)
from scalerl.tracking.plot import plot_metrics

__all__ = [
    "DEFAULT_BACKENDS",
    "KEY_METRICS",
    "VALID_BACKENDS",
    "ConsoleBackend",
    "JsonlBackend",
    "MetricsBackend",
    "MetricsLogger",
    "MlflowBackend",
    "TensorBoardBackend",
    "WandbBackend",
    "plot_metrics",
    "read_metrics_jsonl",
]
