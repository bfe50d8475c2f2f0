"""The `trainer` and `sft` sections' own checks, and the choice lists they share with the metric sinks and
the autocast precisions (where their truth lives)."""

from __future__ import annotations

import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.core.config.trainer import LOGGERS, PRECISIONS


@pytest.mark.parametrize("override, key", [
    ("sft.lr=-1", "sft.lr must be > 0"),
    ("trainer.precision=fp8", "trainer.precision must be one of fp32, bf16, fp16"),
    ("trainer.logger=[console,neptune]", "trainer.logger[1] must be one of"),
])
def test_impossible_values(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_metric_backends():
    from scalerl.tracking.metrics_logger import VALID_BACKENDS

    assert set(LOGGERS) == set(VALID_BACKENDS)


def test_precisions():
    from scalerl.core.device import AUTOCAST_DTYPES

    assert set(PRECISIONS) == {"fp32", "auto", *AUTOCAST_DTYPES}  # auto resolves to fp32 or bf16
