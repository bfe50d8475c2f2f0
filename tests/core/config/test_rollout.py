"""The `rollout` section's own keys: sampling bounds, the off-policy correction, staleness and partial
rollouts (with the one cross-section refusal staleness meets, dynamic sampling)."""

from __future__ import annotations

import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.core.config.rollout import ROLLOUT_DTYPES


@pytest.mark.parametrize("override, key", [
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.temperature=-0.1", "rollout.temperature must be >= 0"),
])


def test_impossible_values(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_off_policy_correction_keys():
    from scalerl.core.config import load_config

    assert load_config(None, []).rollout.correction_cap == 2.0
    assert load_config(None, ["rollout.tis_cap=0"]).rollout.correction_cap == 0.0  # the alias wins when set
    assert load_config(None, ["rollout.is_cap=3.5"]).rollout.correction_cap == 3.5
    for override, key in (("rollout.is_level=row", "rollout.is_level"), ("rollout.is_mode=clip", "rollout.is_mode"),
                          ("rollout.is_cap=-1", "rollout.is_cap"), ("rollout.tis_cap=-1", "rollout.tis_cap")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])


def test_staleness_beyond_one_step():
    from scalerl.core.config import load_config

    assert load_config(None, ["rollout.placement=standalone", "rollout.staleness=4"]).rollout.staleness == 4
    with pytest.raises(ConfigError, match="rollout.staleness"):
        load_config(None, ["rollout.placement=standalone", "rollout.staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.staleness=2 with algorithm.filter_groups"):
        load_config(None, ["rollout.placement=standalone", "rollout.staleness=2", "algorithm.filter_groups.enable=true"])


def test_partial_rollouts_need_standalone_workers_and_staleness():
    from scalerl.core.config import load_config

    ok = ["rollout.placement=standalone", "rollout.staleness=2", "rollout.partial=true"]
    assert load_config(None, ok).rollout.partial is True
    for bad in (["rollout.partial=true"], ["rollout.placement=standalone", "rollout.partial=true"]):
        with pytest.raises(ConfigError, match=r"rollout.partial=true needs rollout.placement=standalone and "
                                              r"rollout.staleness >= 1"):
            load_config(None, bad)


def test_rollout_dtypes_are_precision_dtypes():
    from scalerl.core.device import PRECISION_DTYPES

    assert set(ROLLOUT_DTYPES) <= set(PRECISION_DTYPES)  # each name has its torch dtype
