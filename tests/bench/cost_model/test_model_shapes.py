"""The Qwen2.5 shapes the cost model projects to: their parameter counts are the model cards'."""

from __future__ import annotations

import pytest

from scalerl.bench.cost_model.model_shapes import (
    QWEN25_CARD_PARAMS_B,
    QWEN25_SHAPES,
    model_shape,
)
from scalerl.perf.flops import decoder_param_count


@pytest.mark.parametrize("name", list(QWEN25_SHAPES))
def test_parameter_counts_match_the_model_cards(name):
    cfg = model_shape(name)
    assert decoder_param_count(cfg) / 1e9 == pytest.approx(QWEN25_CARD_PARAMS_B[name], rel=0.01)
    assert cfg.tie_word_embeddings == (decoder_param_count(cfg) < 5e9)  # the small ones tie, 7B and up do not


def test_names():
    assert model_shape("7b").hidden_size == model_shape("Qwen2.5-7B").hidden_size == 3584
    with pytest.raises(KeyError, match="known: qwen2.5-0.5b"):
        model_shape("llama-70b")
