"""Config loading: YAML + overrides precedence, type parsing, and errors that name the dotted key."""

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


def test_defaults_are_valid():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.actor.lr == 1e-4 and cfg.trainer.logger == ["console", "jsonl"]


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


@pytest.mark.parametrize("override, key", [
    ("actor.lr=0", "actor.lr must be > 0"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.temperature=-0.1", "rollout.temperature must be >= 0"),
    ("actor.clip_ratio_low=-0.1", "actor.clip_ratio_low must be >= 0"),
    ("sft.lr=-1", "sft.lr must be > 0"),
    ("actor.loss_agg_mode=mean", "actor.loss_agg_mode must be one of token-mean, token-sum"),
    ("actor.kl_loss_type=k9", "actor.kl_loss_type must be one of"),
    ("trainer.precision=fp8", "trainer.precision must be one of fp32, bf16, fp16"),
    ("trainer.logger=[console,neptune]", "trainer.logger[1] must be one of"),
    ("model.num_key_value_heads=3", "model.num_attention_heads (4) must be divisible by model.num_key_value_heads (3)"),
    ("model.hidden_size=130", "model.hidden_size (130) must be divisible by model.num_attention_heads (4)"),
    ("data.reward=nonsense", "data.reward must be one of"),
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


def test_valid_choices_pass():
    cfg = load_config(None, ["actor.kl_loss_type=k3+", "data.reward=my_rewards.py:score",
                             "algorithm.adv_estimator=gae", "rollout.n=1", "actor.ppo_mini_batch_size=16",
                             "model.path=/some/hf/model", "model.num_key_value_heads=3"])
    assert cfg.actor.kl_loss_type == "k3+"


def test_hook_only_compression_needs_plain_data_parallelism():
    for layout in ("parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2"):
        with pytest.raises(ConfigError, match=r"comm.gradient_compression=topk needs plain data parallelism \(DDP\)"):
            load_config(None, ["comm.gradient_compression=topk", layout])
    cfg = load_config(None, ["comm.gradient_compression=bf16", "parallel.dp_shard=2"])  # FSDP's reduce dtype
    assert cfg.comm.gradient_compression == "bf16"


def test_batch_divisibility():
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size \(48\) must divide "
                                          r"trainer.batch_size \* rollout.n = 16 \* 8 = 128"):
        load_config(None, ["actor.ppo_mini_batch_size=48"])
    with pytest.raises(ConfigError, match=r"actor.ppo_micro_batch_size \(24\) must divide "
                                          r"actor.ppo_mini_batch_size \(64\)"):
        load_config(None, ["actor.ppo_micro_batch_size=24"])
    load_config(None, ["trainer.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                       "actor.ppo_micro_batch_size=2"])


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


def test_sequence_parallel_refusals_name_the_keys():
    assert load_config(None, ["parallel.sp=2"]).parallel.sp == 2  # 4 heads over 2 kv heads: both divide
    assert load_config(None, ["parallel.sp=4"]).parallel.sp == 4  # 2 kv heads, each replicated twice
    for overrides, message in [
        (["parallel.sp=0"], r"parallel.sp must be >= 1"),
        (["parallel.sp=3"], r"parallel.sp=3 does not divide model.num_attention_heads=4"),
        (["parallel.sp=4", "model.num_attention_heads=12", "model.num_key_value_heads=3", "model.hidden_size=48"],
         r"parallel.sp=4 and model.num_key_value_heads=3"),
        (["parallel.sp=2", "parallel.pp=2"], r"parallel.sp=2 with parallel.pp=2"),
        (["parallel.sp=2", "model.implementation=transformers"], r"parallel.sp=2 with model.implementation=transformers"),
        (["parallel.sp=2", "rollout.placement=standalone"], r"parallel.sp=2 with rollout.placement=standalone"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


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
