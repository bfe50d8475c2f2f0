"""GRPO with rollout.engine=vllm colocated, on the real engine where vLLM is installed (the CPU build:
scripts/install_vllm_cpu.sh): after every update the policy is loaded into vLLM, which then generates
exactly what the built-in engine generates with the trained weights; its sampled log-probs differ from
the training forward by float noise only, reported as rollout/logprob_diff and weighed in by TIS."""

import importlib.util

import pytest
import torch

from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.trainer.rl_trainer import RLTrainer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")

# vLLM's CPU attention needs head_dim >= 32: the tiny model with 2 heads of 64.
VLLM_MODEL = ("model.hidden_size=128", "model.num_attention_heads=2", "model.num_key_value_heads=1",
              "rollout.engine=vllm", "rollout.vllm_kv_cache_gib=0.25", "trainer.total_steps=2")


def test_colocated_grpo_loads_every_update_into_vllm(tiny_config, length_reward):
    trainer = RLTrainer.from_config(tiny_config(*VLLM_MODEL, length_reward))
    try:
        before = trainer.policy.model.layers[0].mlp.up_proj.weight.clone()
        metrics = [trainer.train_step() for _ in range(2)]
        assert not torch.equal(before, trainer.policy.model.layers[0].mlp.up_proj.weight)  # it trained
        for m in metrics:
            assert m["comm/weight_sync_bytes"] == sum(p.numel() * 4 for p in trainer.policy.model.parameters())
            assert 0 <= m["rollout/logprob_diff/mean"] < 1e-4 and m["rollout/logprob_diff/max"] < 1e-3, m
        assert trainer.engine.loads == 2
        prompts = [trainer.tokenizer.encode(text) for text in ("3+4=", "12+30=", "7+7=")]
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
        ours = BuiltinEngine(trainer.policy.model, trainer.tokenizer.pad_token_id).generate(prompts, greedy)
        assert torch.equal(trainer.engine.generate(prompts, greedy).response_ids, ours.response_ids)
    finally:
        trainer.close()
