"""Multi-turn rollouts in the trainer: a one-turn episode trains what today's single-turn step trains (same
tokens, log-probs within fp32 noise), multi-turn episodes train with the user turns masked, and the agent's
metrics come with the step's."""

from __future__ import annotations

import json

import pytest
import torch

from scalerl.rollout.agent.source import AgentRollouts
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.trainer.rl_trainer import RLTrainer

# Continuous batching on both sides (the agent loop runs on the continuous engine), the chat template on (the
# agent renders the first messages through it), so the only difference is the agent loop itself.
SAME = ["data.chat_template=true", "rollout.max_num_seqs=16", "trainer.total_steps=2"]


def _lines(trainer):
    return [json.loads(x) for x in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["step"] > 0]


def test_a_one_turn_episode_trains_what_the_single_turn_step_does(tiny_config, length_reward, tmp_path):
    single = RLTrainer.from_config(tiny_config(*SAME, length_reward, f"trainer.output_dir={tmp_path}/single"))
    batches = []
    single.on_batch = batches.append
    single.fit()
    agent = RLTrainer.from_config(tiny_config(*SAME, length_reward, "rollout.agent.env=chat",
                                              f"trainer.output_dir={tmp_path}/agent"))
    assert isinstance(agent.rollouts, AgentRollouts)
    agent_batches = []
    agent.on_batch = agent_batches.append
    agent.fit()
    for a, b in zip(batches, agent_batches):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
        assert (a.rollout_logprobs - b.rollout_logprobs).abs().max() < 1e-5
    for a, b in zip(single.policy.model.parameters(), agent.policy.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    rows = _lines(agent)
    assert all(r["agent/turns/max"] == 1 and r["agent/environment_tokens"] == 0 for r in rows)


def test_multi_turn_episodes_train_with_the_user_turns_out_of_the_loss(tiny_config, length_reward, tmp_path):
    turns = tmp_path / "chat.jsonl"
    turns.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "ground_truth": str(2 * a), "turns": ["again"]})
                             + "\n" for a in range(1, 21)))
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=1", "rollout.agent.env=chat", "rollout.agent.max_turns=2", f"data.train_files=[{turns}]",
        f"data.val_files=[{turns}]", length_reward, f"trainer.output_dir={tmp_path}/multi"))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    batch = batches[0]
    untrained = (batch.response_attention > 0) & (batch.response_mask == 0)
    assert untrained.sum() == len(batch) * len("again")  # each episode's user turn, in the sequence, untrained
    assert not batch.old_logprobs[untrained].any() and not batch.advantages[untrained].any()
    row = _lines(trainer)[0]
    assert row["agent/turns/max"] == 2 and row["agent/environment_tokens"] == len(batch) * len("again")


def test_the_environments_own_reward_scores_its_episodes(tiny_config, length_reward, tmp_path):
    """An environment that gives a reward scores its episode; the run's reward function scores the others."""
    env = tmp_path / "graded.py"
    env.write_text("class Graded:\n"
                   "    def reset(self, row):\n        self.odd = int(row['ground_truth']) % 2\n"
                   "        return [{'role': 'user', 'content': row['prompt']}]\n"
                   "    def step(self, message):\n        return [], (0.25 if self.odd else None), True, {}\n")
    trainer = RLTrainer.from_config(tiny_config("trainer.total_steps=1", f"rollout.agent.env={env}:Graded",
                                                length_reward, f"trainer.output_dir={tmp_path}/graded"))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    batch = batches[0]
    texts = trainer.tokenizer.batch_decode(batch.response_ids.tolist())
    scores = batch.scores.tolist()
    from_env = [s for s in scores if s == 0.25]
    from_fn = [(s, t) for s, t in zip(scores, texts) if s != 0.25]
    assert from_env and from_fn  # both kinds of rows in the batch
    assert all(abs(s - len(t) / 10) < 1e-6 for s, t in from_fn)  # the length reward where the env gave none


def test_evaluation_runs_episodes_in_the_environment_the_run_trains_in(tiny_config, length_reward, tmp_path):
    """val/accuracy of an agent run comes from whole episodes: here only a second turn earns the environment's
    reward, so a single-turn evaluation (the run's length reward on one answer) would read otherwise."""
    env = tmp_path / "two_turns.py"
    env.write_text("class TwoTurns:\n"
                   "    def reset(self, row):\n        self.turn = 0\n"
                   "        return [{'role': 'user', 'content': row['prompt']}]\n"
                   "    def step(self, message):\n        self.turn += 1\n"
                   "        if self.turn == 1:\n            return [{'role': 'user', 'content': 'more'}], None, False, {}\n"
                   "        return [], 1.0, True, {}\n")
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=1", f"rollout.agent.env={env}:TwoTurns", "rollout.agent.max_turns=2", "trainer.val_n=2",
        "rollout.val_temperature=1.0", length_reward, f"trainer.output_dir={tmp_path}/eval"))
    metrics = trainer.evaluate()
    assert metrics["val/accuracy"] == 1.0 and metrics["val/score/mean"] == 1.0 and metrics["val/pass@2"] == 1.0
    one_turn = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=1", f"rollout.agent.env={env}:TwoTurns", "rollout.agent.max_turns=1",
        length_reward, f"trainer.output_dir={tmp_path}/one"))
    texts, lengths, given = one_turn.rollouts.episodes(one_turn.val_rows[:4], SamplingParams(
        max_new_tokens=4, temperature=0.0, stop_token_ids=one_turn.tokenizer.stop_token_ids))
    assert given == [None] * 4 and lengths == [len(one_turn.tokenizer.encode(t)) for t in texts]
    assert one_turn.evaluate()["val/accuracy"] == 0.0  # one turn: no environment reward, the length reward < 1


def test_the_tool_environment_gets_a_sandboxed_python_tool_from_the_config(capsys):
    import asyncio

    import pytest

    from scalerl.core.config import ConfigError, load_config
    from scalerl.rollout.agent.sandbox import SandboxError
    from scalerl.rollout.agent.source import environment_factory

    with pytest.raises(ConfigError, match="rollout.agent.env=tools needs rollout.agent.tools"):
        load_config(None, ["rollout.agent.env=tools"])
    cfg = load_config(None, ["rollout.agent.env=tools", "rollout.agent.sandbox=process"])
    try:
        env = environment_factory(cfg.rollout.agent)()
    except SandboxError as error:
        pytest.skip(str(error))
    assert list(env.tools) == ["python"] and "rollout.agent.sandbox=process: " in capsys.readouterr().out
    env.reset({"prompt": "6*7?"})
    step = asyncio.run(env.step({"role": "assistant", "content":
                                 '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'}))
    assert step.messages[0]["content"].strip() == "42"


def test_the_agent_limits_come_from_the_config():
    from scalerl.core.config import ConfigError, load_config
    from scalerl.rollout.agent.source import agent_limits

    cfg = load_config(None, ["rollout.agent.env=chat", "rollout.agent.max_turns=3", "rollout.agent.env_timeout_s=2.5",
                             "data.max_prompt_length=40", "rollout.max_new_tokens=10"])
    limits = agent_limits(cfg)
    assert (limits.max_turns, limits.env_timeout_s, limits.max_total_tokens) == (3, 2.5, 40 + 3 * (10 + 64))
    with pytest.raises(ConfigError, match="rollout.agent.env_timeout_s"):
        load_config(None, ["rollout.agent.env_timeout_s=0"])
