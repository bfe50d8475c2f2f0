"""The `actor` section's own keys: bounds and choices named in the message, the micro-batch dividing the
mini-batch; and its choice lists agree with the algorithms' and the optimizer's, where their truth lives (a
config valid here must not fail deep in a run, nor a real choice be refused)."""

from __future__ import annotations

import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.core.config.actor import KL_LOSS_TYPES, LOSS_AGG_MODES, LR_SCHEDULES


@pytest.mark.parametrize("override, key", [
    ("actor.lr=0", "actor.lr must be > 0"),
    ("actor.clip_ratio_low=-0.1", "actor.clip_ratio_low must be >= 0"),
    ("actor.loss_agg_mode=mean", "actor.loss_agg_mode must be one of token-mean, token-sum"),
    ("actor.kl_loss_type=k9", "actor.kl_loss_type must be one of"),
])
def test_impossible_values(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_micro_batch_divides_the_mini_batch():
    with pytest.raises(ConfigError, match=r"actor.ppo_micro_batch_size \(24\) must divide "
                                          r"actor.ppo_mini_batch_size \(64\)"):
        load_config(None, ["actor.ppo_micro_batch_size=24"])


def test_loss_aggregation_modes():
    from scalerl.algorithms.losses import AGG_MODES

    assert set(LOSS_AGG_MODES) == set(AGG_MODES)


def test_kl_kinds():
    from scalerl.algorithms.kl import KL_KINDS

    assert set(KL_LOSS_TYPES) == set(KL_KINDS)


def test_lr_schedules():
    from scalerl.trainer.optim import LR_SCHEDULES as OPTIMIZER_SCHEDULES

    assert set(LR_SCHEDULES) == set(OPTIMIZER_SCHEDULES)
