"""Metrics output: per-step logging to console / jsonl / TensorBoard / W&B / MLflow, and metric plots."""

from scalerl.tracking.backend import MetricsBackend
from scalerl.tracking.console_backend import KEY_METRICS, ConsoleBackend
from scalerl.tracking.jsonl_backend import JsonlBackend, read_metrics_jsonl
from scalerl.tracking.metrics_logger import (
    DEFAULT_BACKENDS,
    VALID_BACKENDS,
    MetricsLogger,
)
from scalerl.tracking.plot import plot_metrics
from scalerl.tracking.service_backends import MlflowBackend, WandbBackend
from scalerl.tracking.tensorboard_backend import TensorBoardBackend

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
