"""The `model` section's own checks: the built-in model's heads divide its width (in even head widths) and
its kv heads divide its heads; its dtypes are torch's."""

from __future__ import annotations

import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.core.config.model import DTYPES


@pytest.mark.parametrize("override, key", [
    ("model.num_key_value_heads=3", "model.num_attention_heads (4) must be divisible by model.num_key_value_heads (3)"),
    ("model.hidden_size=130", "model.hidden_size (130) must be divisible by model.num_attention_heads (4)"),
])
def test_impossible_values(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_parameter_dtypes_are_torch_dtypes():
    import torch

    assert all(isinstance(getattr(torch, name), torch.dtype) for name in DTYPES)
