"""The `data` section: the keys for file formats and column names (listed, defaulted like verl's, checked,
reaching the loader), the reward spec, and its choice lists against the loaders' and the rewards'."""

from __future__ import annotations

import pytest

from scalerl.cli import main
from scalerl.core.config import ConfigError, load_config
from scalerl.core.config.data import BUILTIN_REWARDS, DATA_FORMATS
from scalerl.data.sources import rows_from_config

KEYS = ("data.format", "data.prompt_key", "data.ground_truth_key", "data.reward_fn_key", "data.split",
        "data.val_split")


def test_keys_are_listed_with_verl_defaults(capsys):
    assert main(["config", "--keys"]) == 0
    listed = capsys.readouterr().out
    for key in KEYS:
        assert f"  {key} (" in listed
    data = load_config().data
    assert (data.format, data.prompt_key, data.ground_truth_key, data.reward_fn_key) == (
        "auto", "prompt", None, "data_source")  # verl's data.prompt_key and data.reward_fn_key defaults
    assert (data.split, data.val_split) == ("train", "test")


@pytest.mark.parametrize("overrides, message", [
    (["data.format=csv"], "data.format must be one of auto, gsm8k, math, rows, verl, trl; got 'csv'"),
    (["data.train_files=[a.parquet]", "data.prompt_key= "], "data.prompt_key must be a non-empty column"),
    (["data.train_files=[a.parquet]", "data.split="], "data.split must be a non-empty"),
    (["data.format=verl"], "data.format=verl is not used by data.task=arithmetic without data.train_files"),
    (["data.reward=nonsense"], "data.reward must be one of"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_keys_reach_the_loader(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"q": [{"role": "user", "content": "1+1?"}], "gold": {"v": "2"}, '
                                         '"src": "mine"}\n')
    data = load_config(None, [f"data.train_files=[{tmp_path / 'rows.jsonl'}]", "data.format=verl",
                              "data.prompt_key=q", "data.ground_truth_key=gold.v", "data.reward_fn_key=src"]).data
    (row,) = rows_from_config(data, "train", seed=0)
    assert (row["prompt"][0]["content"], row["ground_truth"], row["data_source"]) == ("1+1?", "2", "mine")


def test_builtin_rewards():
    from scalerl.data import BUILTIN_REWARDS as RULE_REWARDS

    # none: a reward model alone; judge: a generative judge model (data.judge, scalerl/data/rewards/judge.py)
    assert set(BUILTIN_REWARDS) == {"auto", "none", "judge", *RULE_REWARDS}


def test_data_formats():
    from scalerl.data.loaders import KINDS

    assert set(DATA_FORMATS) == set(KINDS)
