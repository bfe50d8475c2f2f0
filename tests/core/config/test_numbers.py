"""Every number in the config is checked alike: finite (whatever its spelling), within the bounds its field
declares, with the dotted key in the message; and every float key declares bounds."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from scalerl.core.config import Config, ConfigError, load_config
from scalerl.core.config.numbers import describe_bounds, number_problems


def _float_fields():
    for name, section in typing.get_type_hints(Config).items():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if hints[f.name] in (float, list[float]):
                yield f"{name}.{f.name}", f


def test_every_float_key_declares_its_bounds():
    undeclared = [key for key, f in _float_fields() if not f.metadata.get("bounds")]
    assert not undeclared, f"declare bounds with opt(..., at_least=/above=/at_most=/below=) for {undeclared}"


@pytest.mark.parametrize("spelling", ["inf", "-inf", ".inf", "Infinity", "nan", ".NaN", "1e400"])
def test_every_float_key_refuses_non_finite_values(spelling):
    for key, _ in _float_fields():
        value = f"[{spelling},0.5]" if key in ("actor.betas", "data.reward_weights") else spelling
        with pytest.raises(ConfigError, match=rf"{key}(\[0\])? must be a finite number"):
            load_config(None, [f"{key}={value}"])


def test_bounds_are_described_and_checked():
    assert describe_bounds({"above": 0, "at_most": 1}) == "in (0, 1]"
    assert describe_bounds({"at_least": 0}) == ">= 0" and describe_bounds({"below": 1}) == "< 1"
    assert number_problems("k", 0.0, {"above": 0}) == ["k must be > 0, got 0.0"]
    assert number_problems("k", [0.5, 1.0], {"at_least": 0, "below": 1}) == ["k[1] must be in [0, 1), got 1.0"]
    assert number_problems("k", 3, {}) == [] and number_problems("k", "text", {"above": 0}) == []


def test_keys_list_shows_the_bounds():
    from scalerl.core.config import describe_keys

    assert "actor.lr (float > 0, default 0.0001)" in describe_keys()
    assert "rollout.top_p (float in (0, 1], default 1.0)" in describe_keys()
