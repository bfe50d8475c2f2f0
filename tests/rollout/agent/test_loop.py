"""The agent loop on the built-in continuous engine: trajectories are token-exact (the engine's log-probs are
the training forward's at every trained position of the laid-out batch), a slow environment delays only its
own trajectory, seeded runs reproduce whatever the timing, and a failing environment ends its episode only."""

from __future__ import annotations

import asyncio
import time

import torch

from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.environment import ChatEnvironment, EnvStep
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop, TokenEpisode, agent_metrics
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import TrajectorySegment, trajectories_to_output
from scalerl.trainer.forward_passes import response_logprobs
from tests.tiny import tiny_model

TOK = CharTokenizer()
ROWS = [{"prompt": f"{a}+{b}=", "turns": ["again?", "sure?"]} for a, b in ((1, 2), (30, 4), (5, 66), (7, 8))]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, stop_token_ids=TOK.stop_token_ids)


def _loop(model, make_env=ChatEnvironment, limits=AgentLimits(max_turns=3, max_total_tokens=64)):
    engine = BuiltinEngine(model, TOK.pad_token_id).continuous_engine(limits.max_total_tokens, SAMPLING.max_new_tokens,
                                                                      max_num_seqs=4)
    return AgentLoop(engine, TOK, make_env, limits)


class SlowFirstRow(ChatEnvironment):
    """The first row's environment takes 1.5 s to answer its first turn."""

    def step(self, message):
        if self.slow:
            self.slow = False
            time.sleep(1.5)
        self.finished_at = time.perf_counter()
        return super().step(message)

    def reset(self, row):
        self.slow = row is ROWS[0]
        return super().reset(row)


class Failing(ChatEnvironment):
    def step(self, message):
        if message is not None and self.turns and self.turns[0] == "again?" and self.row_id == 2:
            raise ValueError("the environment broke")
        return super().step(message)

    def reset(self, row):
        self.row_id = ROWS.index(row)
        return super().reset(row)


def test_trajectories_are_token_exact_and_alternate_engine_and_environment_segments():
    model = tiny_model(vocab_size=128).eval()
    trajectories, records = _loop(model).run(ROWS, SAMPLING)
    for t, r, row in zip(trajectories, records, ROWS):
        assert t.prompt_ids == TOK.encode(row["prompt"])  # the built-in template: contents joined
        kinds = [s.generated for s in t.segments]
        assert kinds == [True, False] * (len(kinds) // 2) + [True] * (len(kinds) % 2)
        for segment, text in zip([s for s in t.segments if not s.generated], row["turns"]):
            assert segment.token_ids == TOK.encode(text)  # only the new message's tokens, never a re-render
        assert t.num_turns <= 3 and r.end in ("done", "max_turns")
    out = trajectories_to_output(trajectories, TOK.pad_token_id)
    batch = RolloutBatch.from_generation(out, torch.arange(4), torch.zeros(4))
    assert batch.response_mask.sum() < batch.response_attention.sum()  # the user turns are in, untrained
    metrics = agent_metrics(records, trajectories, 1.0)
    assert metrics["agent/turns/max"] <= 3 and metrics["agent/environment_tokens"] > 0


def test_the_engines_logprobs_are_the_training_forwards_at_every_trained_position():
    model = tiny_model(vocab_size=128).eval()
    trajectories, _ = _loop(model).run(ROWS, SAMPLING)
    batch = RolloutBatch.from_generation(trajectories_to_output(trajectories, TOK.pad_token_id), torch.arange(4),
                                         torch.zeros(4))
    forward = response_logprobs(model, batch, 1.0, 4)
    trained = batch.response_mask.bool()
    assert torch.isfinite(batch.rollout_logprobs[trained]).all()
    assert torch.allclose(forward[trained], batch.rollout_logprobs[trained], atol=1e-4)


def test_a_slow_environment_delays_only_its_own_trajectory_and_seeded_runs_reproduce():
    model = tiny_model(vocab_size=128).eval()
    envs = []

    def make_env():
        envs.append(SlowFirstRow())
        return envs[-1]

    began = time.perf_counter()
    slow, _ = _loop(model, make_env).run(ROWS, SAMPLING)
    finished = sorted(getattr(e, "finished_at", began) - began for e in envs[1:])
    assert finished[-1] < 1.4  # every other episode answered its last turn while the first one's tool slept
    quick, _ = _loop(model).run(ROWS, SAMPLING)
    assert [t.response_ids for t in slow] == [t.response_ids for t in quick]  # its own draws, whatever the timing


def test_a_failing_environment_ends_its_episode_only_with_the_class_method_and_turn():
    model = tiny_model(vocab_size=128).eval()
    trajectories, records = _loop(model, Failing).run(ROWS, SAMPLING)
    assert records[2].end == "env_error"
    assert records[2].info["error"] == "Failing.step raised at turn 1: ValueError: the environment broke"
    assert all(r.end != "env_error" for i, r in enumerate(records) if i != 2)
    assert agent_metrics(records, trajectories, 1.0)["agent/env_errors"] == 1


def test_the_token_budget_ends_an_episode_mid_conversation():
    model = tiny_model(vocab_size=128).eval()
    trajectories, records = _loop(model, limits=AgentLimits(max_turns=8, max_total_tokens=14)).run(ROWS, SAMPLING)
    assert all(len(t.prompt_ids) + len(t.response_ids) <= 14 for t in trajectories)
    assert any(r.end == "budget" for r in records)
    assert all(t.finish_reason == "length" for t, r in zip(trajectories, records) if r.end == "budget")


def test_an_environment_written_with_tuples_and_async_methods_works_as_is():
    class AsyncTuples:
        async def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        async def step(self, message):
            return [], 1.0, True, {"seen": message["content"]}

    model = tiny_model(vocab_size=128).eval()
    trajectories, records = _loop(model, AsyncTuples).run(ROWS[:2], SAMPLING)
    assert [r.reward for r in records] == [1.0, 1.0] and all(r.end == "done" for r in records)
    assert records[0].info["seen"] == TOK.decode(trajectories[0].segments[0].token_ids)
    assert isinstance(EnvStep().messages, list)


def test_an_environment_that_never_answers_ends_its_episode_at_the_limit():
    class Hangs(ChatEnvironment):
        async def step(self, message):
            await asyncio.sleep(60)

    model = tiny_model(vocab_size=128).eval()
    began = time.perf_counter()
    _, records = _loop(model, Hangs, AgentLimits(max_turns=3, max_total_tokens=64, env_timeout_s=0.3)).run(
        ROWS[:2], SAMPLING)
    assert time.perf_counter() - began < 10 and all(r.end == "env_error" for r in records)
    assert "Hangs.step raised at turn 1: TimeoutError" in records[0].info["error"]


# ---- the token-level escape hatch: run(generate, row) ------------------------------------------------------------
class TwoTurns:
    """Drives generation itself: a turn, then its own context tokens, then a second turn on exactly that."""

    def __init__(self, cheat=None):
        self.cheat = cheat

    async def run(self, generate, row):
        prompt = TOK.encode(row["prompt"])
        first = await generate(prompt)
        glue = TOK.encode("|ok|")
        second_prompt = prompt + first.token_ids + glue
        if self.cheat == "re-render":
            second_prompt = TOK.encode(row["prompt"] + "?") + first.token_ids + glue
        second = await generate(second_prompt, max_new_tokens=3)
        segments = [first, glue, second]
        if self.cheat == "fabricate":
            segments[2] = TrajectorySegment(second.token_ids, True, second.logprobs)  # not what generate returned
        return TokenEpisode(prompt, segments, reward=float(len(second.token_ids)), info={"mine": 1})


class Forever:
    async def run(self, generate, row):
        ids = TOK.encode(row["prompt"])
        while True:
            ids = ids + (await generate(ids, max_new_tokens=2)).token_ids


def test_a_token_level_environment_drives_generation_and_is_held_to_what_the_engine_saw():
    model = tiny_model(vocab_size=128).eval()
    trajectories, records = _loop(model, TwoTurns).run(ROWS, SAMPLING)
    for t, r, row in zip(trajectories, records, ROWS):
        first, glue, second = t.segments
        assert t.prompt_ids == TOK.encode(row["prompt"]) and glue.token_ids == TOK.encode("|ok|")
        assert first.generated and second.generated and not glue.generated and len(second.token_ids) <= 3
        assert r.end == "done" and r.reward == len(second.token_ids) and r.info["mine"] == 1
    out = trajectories_to_output(trajectories, TOK.pad_token_id)
    batch = RolloutBatch.from_generation(out, torch.arange(4), torch.zeros(4))
    # the engine's log-probs are the training forward's at every trained position, as for message-level episodes
    logprobs = response_logprobs(model, batch, 1.0, 4)
    trained = batch.response_mask.bool()
    assert torch.allclose(logprobs[trained], batch.rollout_logprobs[trained], atol=1e-4)
    for cheat, message in [("fabricate", "generated segment"), ("re-render", "differs from the trajectory")]:
        _, records = _loop(model, lambda: TwoTurns(cheat)).run(ROWS[:1], SAMPLING)
        assert records[0].end == "env_error" and message in records[0].info["error"], records[0].info
    trajectories, records = _loop(model, Forever).run(ROWS[:1], SAMPLING)
    assert records[0].end == "max_turns" and "max_turns is 3" in records[0].info["error"]
    assert [s.generated for s in trajectories[0].segments] == [True, True, True]  # the three calls, chained
