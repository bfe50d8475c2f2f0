"""The whole run's `Config`: its defaults load, and the checks that read more than one section (batch sizes
against the group size, estimators against sampling, layouts against compression, sequence parallelism,
the built-in model's shape) name every key involved."""

from __future__ import annotations

import pytest

from scalerl.core.config import Config, ConfigError, load_config


def test_defaults_are_valid():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.actor.lr == 1e-4 and cfg.trainer.logger == ["console", "jsonl"]


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


def test_mini_batch_divides_the_rollouts():
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size \(48\) must divide "
                                          r"trainer.batch_size \* rollout.n = 16 \* 8 = 128"):
        load_config(None, ["actor.ppo_mini_batch_size=48"])
    load_config(None, ["trainer.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                       "actor.ppo_micro_batch_size=2"])


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
