"""A verifiers-style environment (classes written to verifiers' published interface: `verifiers_stand_in`) runs
its own rollout loop on an ``AsyncOpenAI`` client of the in-run endpoint: it trains the tiny model with its
rubric's reward, the trained ids the engine's; a tool environment's tool call round-trips; the token-in route
verifiers' train client calls (``/inference/v1/generate``) answers as vLLM does; bad specs are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scalerl.core.errors import UserError
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.endpoint import RolloutEndpoint
from scalerl.rollout.agent.endpoint_source import EndpointEpisodes
from scalerl.rollout.agent.verifiers_env import VerifiersRunner, load_verifiers_env
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.trainer.rl_trainer import RLTrainer
from tests.rollout.agent.conftest import ScriptedTurns
from tests.tiny import tiny_model

pytest.importorskip("openai")

STAND_IN = Path(__file__).with_name("verifiers_stand_in.py")
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_verifiers_environment_trains_the_tiny_model_with_its_rubric(tiny_config, length_reward, tmp_path):
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=2", "trainer.batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size=2", "data.num_val=2", "rollout.agent.env=verifiers",
        f"rollout.agent.verifiers_env={STAND_IN}:load_environment", length_reward,
        f"trainer.output_dir={tmp_path}/run"))
    engine = trainer.rollouts.loop.engine
    sampled, step = [], engine.step

    def spy():
        out = step()
        sampled.extend(out)
        return out

    engine.step = spy
    batches = []
    trainer.on_batch = batches.append
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    trainer.fit()
    assert len(batches) == 2 and len(sampled) == (2 * 4 + 2 * 2) * 2  # steps' and evaluation's episodes, 2 turns
    by_ids = {tuple(o.token_ids.tolist()): o for o in sampled}
    for batch in batches:
        for row in range(len(batch)):
            width = int(batch.response_attention[row].sum())
            ids, mask = batch.response_ids[row].tolist()[:width], batch.response_mask[row].tolist()[:width]
            logprobs = batch.rollout_logprobs[row].tolist()[:width]
            # [first turn: trained] [user turn "again": context] [second turn: trained]
            first = next(i for i, m in enumerate(mask) if not m)
            second = next(i for i in range(first, width) if mask[i])
            assert all(mask[:first]) and not any(mask[first:second]) and all(mask[second:])
            assert "again" in trainer.tokenizer.decode(ids[first:second])
            for a, b in ((0, first), (second, width)):
                out = by_ids[tuple(ids[a:b])]  # ids the engine sampled, with its log-probs
                assert torch.allclose(torch.tensor(logprobs[a:b]), out.logprobs)
            # The rubric's reward (from the token_id:<id> tokens of the last response, as prime-rl reads them).
            assert batch.scores[row].item() == pytest.approx(sum(ids[second:]) % 7 / 7)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.model.parameters()))


def _engine(first: str, rows: int):
    tokenizer = CharTokenizer()
    model = tiny_model(vocab_size=128).eval()
    return BuiltinEngine(model, tokenizer.pad_token_id, logits_processor=ScriptedTurns(rows, first, "5")
                         ).continuous_engine(600, 80, max_num_seqs=4), tokenizer


def test_a_tool_environments_tool_call_round_trips_through_the_endpoint():
    engine, tokenizer = _engine(TOOL_CALL, rows=2)
    runner = VerifiersRunner(f"{STAND_IN}:load_tool_environment")
    episodes = EndpointEpisodes(engine, tokenizer, runner, timeout_s=60)
    rows = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "And 2+3?", "answer": "6"}]
    trajectories, records = episodes.run(rows, SamplingParams(max_new_tokens=80, seed=1))
    assert [r.reward for r in records] == [1.0, 0.0]  # the rubric: the tool's result is the row's answer
    for t in trajectories:
        generated = [s for s in t.segments if s.generated]
        assert len(generated) == 2 and generated[0].token_ids == tokenizer.encode(TOOL_CALL) + [tokenizer.eos_token_id]
        context = [s for s in t.segments if not s.generated]
        assert len(context) == 1 and "5" in tokenizer.decode(context[0].token_ids)  # the tool's result, untrained
        assert tokenizer.decode(t.prompt_ids).startswith("Use the tools.")  # the environment's system prompt
        assert t.reward_inputs["info"]["prefix_breaks"] == 0


def test_the_token_in_route_answers_as_vllms_generate_does():
    """What verifiers' train client (``renderers.client.generate``) sends and checks: ``token_ids`` and
    ``sampling_params`` in; ``prompt_token_ids``, the choice's ``token_ids`` and one ``token_id:<id>`` log-prob
    entry per id out; recorded in the session like any call."""
    import http.client

    engine, tokenizer = _engine("42", rows=1)
    with RolloutEndpoint(engine, tokenizer, sampling=SamplingParams(seed=2)) as endpoint:
        session = endpoint.open_session()
        prompt = tokenizer.encode("6*7=")
        connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=60)
        body = {"model": "m", "token_ids": prompt, "sampling_params": {
            "max_tokens": 10, "logprobs": 1, "skip_special_tokens": False, "stop_token_ids": [tokenizer.eos_token_id]}}
        headers = {"Authorization": f"Bearer {endpoint.token}", "Content-Type": "application/json"}
        # renderers builds the URL from the OpenAI base URL without its /v1
        connection.request("POST", f"/sessions/{session}/inference/v1/generate", json.dumps(body), headers)
        response = connection.getresponse()
        data = json.loads(response.read())
        connection.request("POST", f"/sessions/{session}/inference/v1/generate", json.dumps({"token_ids": []}), headers)
        bad = connection.getresponse()
        refused = json.loads(bad.read())
        trajectories, _ = endpoint.collect(session)
    assert response.status == 200 and data["prompt_token_ids"] == prompt
    choice = data["choices"][0]
    assert choice["token_ids"] == tokenizer.encode("42") + [tokenizer.eos_token_id] and choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(e["logprob"] <= 0 for e in choice["logprobs"]["content"])  # forced by the script: ~0
    assert bad.status == 400 and refused["error"]["param"] == "token_ids"
    assert trajectories[0].prompt_ids == prompt and trajectories[0].segments[0].token_ids == choice["token_ids"]
    assert trajectories[0].segments[0].logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]


def test_bad_verifiers_specs_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="module:load_environment or path/to/file.py:load_environment"):
        load_verifiers_env("no_colon")
    with pytest.raises(UserError, match="has no load_nothing"):
        load_verifiers_env(f"{STAND_IN}:load_nothing")
    not_env = tmp_path / "not_env.py"
    not_env.write_text("def load_environment():\n    return object()\n")
    with pytest.raises(UserError, match="built a object, which has no rollout"):
        load_verifiers_env(f"{not_env}:load_environment")
    raising = tmp_path / "raising.py"
    raising.write_text("def load_environment():\n    raise RuntimeError('no dataset here')\n")
    with pytest.raises(UserError, match="raised: RuntimeError: no dataset here"):
        load_verifiers_env(f"{raising}:load_environment")
    with pytest.raises(UserError, match=r"verifiers_env_args='\[1\]': give a JSON object"):
        load_verifiers_env(f"{STAND_IN}:load_environment", "[1]")
    assert load_verifiers_env(f"{STAND_IN}:load_tool_environment", '{"max_turns": 5}').max_turns == 5
    from scalerl.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.agent.env=verifiers and rollout.agent.verifiers_env go together"):
        load_config(None, ["rollout.agent.env=verifiers"])


def test_the_example_environment_runs_its_tool_loop_and_scores_with_its_rubric():
    example = Path(__file__).resolve().parents[3] / "examples" / "agents" / "verifiers_calculator_env.py"
    engine, tokenizer = _engine('<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>', 1)
    episodes = EndpointEpisodes(engine, tokenizer, VerifiersRunner(f"{example}:load_environment"), timeout_s=60)
    (trajectory,), (record,) = episodes.run([{"prompt": "What is 6*7?", "answer": "42"}],
                                            SamplingParams(max_new_tokens=80, seed=1))
    assert [s.generated for s in trajectory.segments] == [True, False, True]
    assert "42" in tokenizer.decode(trajectory.segments[1].token_ids)  # the tool's result, as context
    assert record.reward == pytest.approx(0.1)  # used the tool; the scripted answer "5" is not 42


# The real token path: `renderers.client.generate`, which verifiers' TrainClient calls, in an interpreter where
# verifiers installs (SCALERL_VERIFIERS_PYTHON; its dependencies are too many for the suite's environment).
REAL_CLIENT = r'''
import asyncio, json, sys
from openai import AsyncOpenAI
from transformers import PreTrainedTokenizerFast
from renderers import create_renderer
from renderers.client import generate
from renderers.configs import DefaultRendererConfig

tokenizer_file, template, base_url, token = sys.argv[1:5]
tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|im_end|>", pad_token="<pad>")
tok.chat_template = template
renderer = create_renderer(tok, DefaultRendererConfig())

async def main():
    client = AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)
    r = await generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "What is 2+3?"}],
                       model="tiny", sampling_params={"max_tokens": 12})
    await client.close()
    print(json.dumps({k: r[k] for k in ("prompt_ids", "completion_ids", "completion_logprobs", "finish_reason")}))

asyncio.run(main())
'''


def test_the_real_verifiers_token_client_reads_what_the_engine_sampled(tmp_path):
    import os
    import subprocess

    python = os.environ.get("SCALERL_VERIFIERS_PYTHON")
    if not python:
        pytest.skip("set SCALERL_VERIFIERS_PYTHON to a Python with verifiers installed (pip install verifiers) to "
                    "run verifiers' own token client (renderers.client.generate) against the endpoint")
    from tests.rollout.agent.chat_templates import QWEN25, chat_tokenizer

    tokenizer = chat_tokenizer(QWEN25)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    model = tiny_model(vocab_size=tokenizer.vocab_size, max_position_embeddings=512).eval()
    engine = BuiltinEngine(model, tokenizer.pad_token_id).continuous_engine(300, 12, max_num_seqs=2)
    with RolloutEndpoint(engine, tokenizer, sampling=SamplingParams(seed=4), model_name="tiny") as endpoint:
        session = endpoint.open_session()
        done = subprocess.run([python, "-c", REAL_CLIENT, str(tmp_path / "tokenizer.json"), QWEN25,
                               endpoint.base_url(session), endpoint.token], check=False, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        (trajectory,), _ = endpoint.collect(session)
    assert seen["prompt_ids"] == trajectory.prompt_ids == tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True))
    (segment,) = trajectory.segments
    assert seen["completion_ids"] == segment.token_ids and seen["completion_logprobs"] == segment.logprobs
