"""The config schema (layer 0) repeats choice lists whose truth lives in higher layers: they must agree,
or a valid config would fail deep in a run (or a real choice be refused)."""

import torch

from scalerl.algorithms.kl import KL_KINDS
from scalerl.algorithms.losses import AGG_MODES
from scalerl.core import config
from scalerl.core.device import AUTOCAST_DTYPES
from scalerl.data.rewards import BUILTIN_REWARDS
from scalerl.parallel.pipeline import SCHEDULES
from scalerl.tracking.metrics_logger import VALID_BACKENDS
from scalerl.trainer.optim import LR_SCHEDULES


def test_loss_aggregation_modes():
    assert set(config.LOSS_AGG_MODES) == set(AGG_MODES)


def test_kl_kinds():
    assert set(config.KL_LOSS_TYPES) == set(KL_KINDS)


def test_metric_backends():
    assert set(config.LOGGERS) == set(VALID_BACKENDS)


def test_pipeline_schedules():
    assert set(config.PP_SCHEDULES) == set(SCHEDULES)


def test_lr_schedules():
    assert set(config.LR_SCHEDULES) == set(LR_SCHEDULES)


def test_precisions():
    assert set(config.PRECISIONS) == {"fp32", "auto", *AUTOCAST_DTYPES}  # auto resolves to fp32 or bf16


def test_builtin_rewards():
    # none: a reward model alone; judge: a generative judge model (data.judge, scalerl/data/reward_judge.py)
    assert set(config.BUILTIN_REWARDS) == {"auto", "none", "judge", *BUILTIN_REWARDS}


def test_parameter_dtypes_are_torch_dtypes():
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in config.DTYPES)


def test_weight_sync_choices():
    from scalerl.comm.weights.sender import MODES
    from scalerl.core.device import PRECISION_DTYPES

    assert set(config.ROLLOUT_DTYPES) <= set(PRECISION_DTYPES)  # each name has its torch dtype
    assert set(config.WEIGHT_SYNC_MODES) == set(MODES)


def test_data_formats():
    from scalerl.data.loaders import KINDS

    assert set(config.DATA_FORMATS) == set(KINDS)
