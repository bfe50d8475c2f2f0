"""The `comm` and `weight_sync` sections: impossible gradient-reduction settings are refused naming the key,
and the weight-sync modes are the sender's."""

from __future__ import annotations

import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.core.config.comm import WEIGHT_SYNC_MODES


@pytest.mark.parametrize("override, key", [
    ("comm.allreduce=ring", "comm.allreduce must be one of auto, flat, hierarchical"),
    ("comm.gradient_compression=int8", "comm.gradient_compression must be one of none, fp16, bf16, powersgd, topk"),
    ("comm.compression_budget=0", "comm.compression_budget must be in (0, 1]"),
    ("comm.topk_density=1.5", "comm.topk_density must be in (0, 1]"),
    ("comm.topk_momentum=1", "comm.topk_momentum must be in [0, 1)"),
    ("comm.powersgd_rank=0", "comm.powersgd_rank must be >= 1"),
    ("comm.inter_node_mbit=-1", "comm.inter_node_mbit must be >= 0"),
])
def test_impossible_values(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_weight_sync_modes():
    from scalerl.comm.weights.sender import MODES

    assert set(WEIGHT_SYNC_MODES) == set(MODES)
