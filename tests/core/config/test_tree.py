"""The generic machinery through scalerl's own schema: YAML + overrides precedence, type parsing, errors that
name the dotted key (with the closest valid key), problems reported together, writing and reading back."""

from __future__ import annotations

import pytest
import yaml

from scalerl.core.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    describe_keys,
    format_config,
    load_config,
    save_config,
)


def write_yaml(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_then_overrides_in_order(tmp_path):
    path = write_yaml(tmp_path, {"actor": {"lr": 3e-5, "grad_clip": 0.5}, "rollout": {"n": 4}})
    cfg = load_config(path, ["rollout.n=16", "rollout.n=2", "trainer.batch_size=32"])
    assert cfg.actor.lr == 3e-5  # from the file
    assert cfg.actor.grad_clip == 0.5
    assert cfg.rollout.n == 2  # the last override wins
    assert cfg.trainer.batch_size == 32
    assert cfg.actor.weight_decay == 0.0  # untouched default


def test_override_value_parsing():
    cfg = load_config(None, [
        "actor.lr=1e-6",  # YAML 1.1 reads this as a string
        "actor.grad_clip=2",  # an int is fine for a float
        "actor.use_kl_loss=true",
        "data.difficulty=[1,2,3]",
        "actor.betas=[0.9,1e-3]",
        "model.path=null",
        "trainer.output_dir=2024",  # a string field keeps the raw text
        "data.task=gsm8k", "data.prompt_template=Q: {question}",  # the built-in task would ignore a template
        "trainer.logger=console,tensorboard",
    ])
    assert cfg.actor.lr == 1e-6 and isinstance(cfg.actor.lr, float)
    assert cfg.actor.grad_clip == 2.0 and isinstance(cfg.actor.grad_clip, float)
    assert cfg.actor.use_kl_loss is True
    assert cfg.data.difficulty == [1, 2, 3]
    assert cfg.actor.betas == [0.9, 1e-3]
    assert cfg.model.path is None
    assert cfg.trainer.output_dir == "2024"
    assert cfg.data.prompt_template == "Q: {question}"
    assert cfg.trainer.logger == ["console", "tensorboard"]


def test_yaml_float_written_with_exponent(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  lr: 1e-6\ncritic:\n  lr: 5e-5\n")
    cfg = load_config(path)
    assert cfg.actor.lr == 1e-6 and cfg.critic.lr == 5e-5


@pytest.mark.parametrize("override, message", [
    ("actor.lrr=1", "unknown key 'actor.lrr'; did you mean 'actor.lr'?"),
    ("actr.lr=1", "did you mean 'actor.lr'?"),
    ("lr=1", "did you mean 'actor.lr'"),
    ("actor.lr=abc", "actor.lr must be a float, got 'abc' (str)"),
    ("rollout.n=true", "rollout.n must be an int, got True (bool)"),
    ("rollout.n=2.5", "rollout.n must be an int"),
    ("data.difficulty=[1,x]", "data.difficulty[1] must be an int"),
    ("trainer.resume=null", "trainer.resume must be a str"),
    ("actor.lr", "has no '='"),
    ("actor=3", "'actor' is a section, not a value"),
    ("actor.lr.x=1", "'actor.lr' is a value, not a section"),
])


def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_unknown_key_and_wrong_type_in_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.temprature'; did you mean 'rollout.temperature'"):
        load_config(write_yaml(tmp_path, {"rollout": {"temprature": 0.5}}))
    with pytest.raises(ConfigError, match=r"trainer.logger must be a list of str"):
        load_config(write_yaml(tmp_path, {"trainer": {"logger": "console"}}))
    with pytest.raises(ConfigError, match=r"actor must be a mapping"):
        load_config(write_yaml(tmp_path, {"actor": 5}))


def test_several_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.lr=-1", "rollout.top_k=-1"])
    assert "2 problems" in str(err.value)
    assert "actor.lr" in str(err.value) and "rollout.top_k" in str(err.value)


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, ["actor.lr=1e-6", "data.train_files=[a.parquet,b.parquet]", "model.path=/m",
                             "trainer.logger=[jsonl]", "sft.output_dir=out/sft"])
    path = tmp_path / "sub" / "resolved.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert config_from_dict(Config, config_to_dict(cfg)) == cfg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("actor:\n")  # an empty file or section means defaults
    assert load_config(empty) == Config()


def test_format_and_describe():
    text = format_config(load_config(None, ["actor.lr=2e-5"]))
    assert "actor:" in text and "lr: 2.0e-05" in text
    keys = describe_keys()
    assert "actor.ppo_mini_batch_size (int, default 64)" in keys
    assert "trainer.init_from (str or null, default null)" in keys
