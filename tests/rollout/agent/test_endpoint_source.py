"""The endpoint as a rollout source inside a run: an agent program in processes of its own, written with the
`openai` client as a harness would (one session per row, its reward posted), trains the tiny model; the
trained ids are the ones the engine sampled, the loss mask 1 exactly on them, the log-probs the engine's, the
scores the rewards posted. A program that crashes, hangs or never calls the model is an error naming it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from scalerl.core.errors import UserError
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.endpoint_source import (
    EndpointEpisodes,
    ProgramRunner,
    program_command,
)
from scalerl.rollout.agent.source import AgentRollouts
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.trainer.rl_trainer import RLTrainer
from tests.tiny import tiny_model

pytest.importorskip("openai")

# The harness: its session from the variables the openai client reads itself, the row from SCALERL_ROW; two
# calls (the second continues the first with a user turn), its reward posted, what it was answered kept.
AGENT = r'''
import json, os, sys, urllib.request
from openai import OpenAI

row = json.loads(os.environ["SCALERL_ROW"])
client = OpenAI(max_retries=0, timeout=120)  # OPENAI_BASE_URL, OPENAI_API_KEY
messages = [{"role": "user", "content": row["prompt"]}]
calls = []
for turn in range(2):
    r = client.chat.completions.create(model=os.environ["SCALERL_MODEL"], messages=messages, max_tokens=6,
                                       temperature=0.3, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True})
    choice = r.choices[0]
    calls.append({"prompt_token_ids": r.prompt_token_ids, "token_ids": choice.token_ids,
                  "logprobs": [c.logprob for c in choice.logprobs.content],
                  "tokens": [c.token for c in choice.logprobs.content]})
    messages += [choice.message, {"role": "user", "content": "again"}]
reward = sum(calls[-1]["token_ids"]) % 7 / 7  # differs within a group: something to learn from
request = urllib.request.Request(os.environ["SCALERL_REWARD_URL"], data=json.dumps({"reward": reward}).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
urllib.request.urlopen(request, timeout=30).read()
with open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w") as f:
    json.dump({"row": row, "calls": calls, "reward": reward}, f)
'''


def test_an_agent_program_in_other_processes_trains_the_tiny_model_token_exact(tiny_config, length_reward, tmp_path):
    program, seen = tmp_path / "agent.py", tmp_path / "seen"
    program.write_text(AGENT)
    seen.mkdir()
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=2", "trainer.batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size=2", "data.num_val=2", "rollout.agent.env=program", f"rollout.agent.program={program} {seen}",
        length_reward, f"trainer.output_dir={tmp_path}/run"))
    assert isinstance(trainer.rollouts, AgentRollouts) and isinstance(trainer.rollouts.loop, EndpointEpisodes)
    engine = trainer.rollouts.loop.engine
    sampled, step = [], engine.step

    def spy():  # what the engine sampled, as its steps returned it
        out = step()
        sampled.extend(out)
        return out

    engine.step = spy
    batches = []
    trainer.on_batch = batches.append
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    trainer.fit()
    # 2 steps x 4 episodes, and evaluation's 2 before and after (its episodes run the program too), 2 calls each
    assert len(batches) == 2 and len(sampled) == (2 * 4 + 2 * 2) * 2
    engine_ids = {tuple(o.token_ids.tolist()): o.logprobs.tolist() for o in sampled}
    records = [json.loads(p.read_text()) for p in seen.iterdir()]
    assert len(records) == 2 * 4 + 2 * 2  # one program run per episode
    for step_index, batch in enumerate(batches):
        for row in range(len(batch)):
            mask = batch.response_mask[row].tolist()
            width = int(batch.response_attention[row].sum())
            ids = batch.response_ids[row].tolist()[:width]
            logprobs = batch.rollout_logprobs[row].tolist()[:width]
            # The trained spans: exactly the ids of two engine outputs, with their log-probs.
            spans, at = [], 0
            while at < width:
                if mask[at]:
                    end = at
                    while end < width and mask[end]:
                        end += 1
                    spans.append((at, end))
                    at = end
                else:
                    at += 1
            assert len(spans) == 2, spans
            for start, end in spans:
                key = tuple(ids[start:end])
                assert key in engine_ids and torch.allclose(torch.tensor(logprobs[start:end]),
                                                            torch.tensor(engine_ids[key]))
            assert not any(mask[width:])
            # What the program was answered is what trained: the record of the program that ran this row (its
            # prompt, both calls' ids and log-probs), and its posted reward is the row's score.
            prompt_width = batch.input_ids.shape[1] - batch.response_ids.shape[1]
            prompt = batch.input_ids[row, :prompt_width][batch.attention_mask[row, :prompt_width].bool()].tolist()
            (a, b), (c, d) = spans
            matching = [r for r in records if r["calls"][0]["prompt_token_ids"] == prompt
                        and r["calls"][0]["token_ids"] == ids[a:b] and r["calls"][1]["token_ids"] == ids[c:d]
                        and r["calls"][1]["prompt_token_ids"] == prompt + ids[:c]]
            assert matching, (row, step_index)
            record = matching[0]
            assert logprobs[a:b] == pytest.approx(record["calls"][0]["logprobs"], abs=1e-6)
            assert logprobs[c:d] == pytest.approx(record["calls"][1]["logprobs"], abs=1e-6)
            assert record["calls"][0]["tokens"] == [f"token_id:{i}" for i in ids[a:b]]
            assert batch.scores[row].item() == pytest.approx(record["reward"])
            assert "again" in trainer.tokenizer.decode(ids[b:c])  # the user turn: context, untrained
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.model.parameters()))
    rows = [json.loads(x) for x in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["agent/turns/max"] for r in rows if r["step"] > 0] == [2, 2]


# ---------------------------------------------------------------------------------------------- bad programs
def _episodes(program: str, timeout_s: float = 60.0) -> EndpointEpisodes:
    tokenizer = CharTokenizer()
    engine = BuiltinEngine(tiny_model(vocab_size=128).eval(), tokenizer.pad_token_id).continuous_engine(
        200, 8, max_num_seqs=4)
    return EndpointEpisodes(engine, tokenizer, ProgramRunner(program), timeout_s=timeout_s)


SAMPLING = SamplingParams(max_new_tokens=8, seed=3)


def test_a_program_that_crashes_is_an_error_naming_it_with_its_stderr(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.stderr.write('the agent broke here\\n')\nsys.exit(3)\n")
    with pytest.raises(UserError, match=r"(?s)crash\.py.*exited with status 3 in session row-0.*the agent broke here"):
        _episodes(str(crash)).run([{"prompt": "1+1="}], SAMPLING)


def test_a_program_that_never_ends_is_stopped_at_the_timeout(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    began = time.monotonic()
    with pytest.raises(UserError, match=r"hang\.py.*did not finish session row-[01].*episode_timeout_s=1 s"):
        _episodes(str(hang), timeout_s=1.0).run([{"prompt": "a"}, {"prompt": "b"}], SAMPLING)
    assert time.monotonic() - began < 30


def test_a_program_that_never_calls_the_model_is_an_error(tmp_path):
    silent = tmp_path / "silent.py"
    silent.write_text("print('nothing to do')\n")
    with pytest.raises(UserError, match=r"silent\.py.*made no model call in session row-0"):
        _episodes(str(silent)).run([{"prompt": "1+1="}], SAMPLING)


def test_the_example_program_runs_as_an_episode_and_posts_its_reward():
    """examples/agents/program_agent.py, as the docs run it: its tool loop on the endpoint, its reward posted
    (the tiny random model does not answer right: 0)."""
    example = Path(__file__).resolve().parents[3] / "examples" / "agents" / "program_agent.py"
    (trajectory,), (record,) = _episodes(str(example)).run([{"prompt": "6*7=", "ground_truth": "42"}], SAMPLING)
    assert record.reward == 0.0 and trajectory.num_turns >= 1
    assert trajectory.reward_inputs["info"]["session_id"] == "row-0"


def test_the_program_setting_is_a_command_line_without_a_shell(tmp_path):
    script = tmp_path / "a b.py"
    script.write_text("")
    command = program_command(f"'{script}' --flag 'two words' ; rm")
    assert command[1:] == [str(script), "--flag", "two words", ";", "rm"]  # ';' is an argument, not a shell
    with pytest.raises(UserError, match="not found"):
        program_command(str(tmp_path / "missing.py"))
    with pytest.raises(UserError, match=r"rollout.agent.program 'no-such-agent-binary --x' could not be started"):
        _episodes("no-such-agent-binary --x").run([{"prompt": "1"}], SAMPLING)
    from scalerl.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.agent.env=program and rollout.agent.program go together"):
        load_config(None, ["rollout.agent.program=x.py"])
