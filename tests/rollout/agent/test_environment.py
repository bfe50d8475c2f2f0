"""Environments: loaded by name with errors that say what is wrong, the built-in tool environment's answers
(results, and errors the model sees), and a whole tool episode through the agent loop on the built-in engine
(the model's text scripted), its tool result in the trajectory as untrained context."""

from __future__ import annotations

import asyncio
import time

import pytest

from scalerl.core.errors import UserError
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.environment import ToolEnvironment, environment_class
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop, agent_metrics
from scalerl.rollout.agent.tools import tool_from_function
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.rollout.agent.conftest import ScriptedTurns
from tests.tiny import tiny_model

TOK = CharTokenizer()


def op(a: int, b: int) -> int:
    """The @ operator, defined only here.

    Args:
        a: left operand
        b: right operand
    """
    return 3 * a - 2 * b


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "late"


def _step(env, text):
    """``env.step`` on an assistant message, and the seconds it took (measured inside the event loop: at exit
    asyncio.run waits for a timed-out tool's thread, which the agent loop abandons instead)."""
    async def timed():
        began = time.perf_counter()
        step = await env.step({"role": "assistant", "content": text})
        step.info["seconds"] = time.perf_counter() - began
        return step

    return asyncio.run(timed())


def test_each_tools_time_is_recorded_and_the_doctor_names_the_slowest():
    """Per-tool seconds from the tool environment, through `agent_metrics`, to the doctor's tool-latency leaf."""
    from scalerl.health import StepView, run_step_rules
    from scalerl.rollout.agent.loop import EpisodeRecord, agent_metrics
    from scalerl.rollout.trajectory import Trajectory

    env = ToolEnvironment([tool_from_function(op), tool_from_function(slow, timeout_s=5)])
    env.reset({"prompt": "3@4="})
    _step(env, '<tool_call>{"name": "op", "arguments": {"a": 3, "b": 4}}</tool_call>')
    step = _step(env, '<tool_call>{"name": "slow", "arguments": {"seconds": 0.3}}</tool_call>'
                      '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    by_name = step.info["tool_s_by_name"]
    assert set(by_name) == {"op", "slow"} and by_name["slow"][1] == 1 and by_name["slow"][0] >= 0.3  # unknown: not timed
    record = EpisodeRecord(info=step.info, env_s=0.9)
    metrics = agent_metrics([record], [Trajectory([1], [])], step_s=1.0)
    assert metrics["agent/tool_s/slow"] >= 0.3 > metrics["agent/tool_s/op"]
    findings = run_step_rules(StepView({"timing_s/step": 1.0, **metrics}, None, {"world_size": 1}))
    (f,) = [f for f in findings if f.leaf == "rollout/tool_latency"]
    assert f.status == "fault" and "the slowest tool is slow" in f.summary and f.evidence["slowest_tool"] == "slow"


def test_environments_load_by_name_and_bad_names_say_why(tmp_path):
    source = tmp_path / "my_env.py"
    source.write_text("class Env:\n    def reset(self, row):\n        return []\n    def step(self, m):\n        return [], 1, True\n"
                      "class NoStep:\n    def reset(self, row):\n        return []\n")
    assert environment_class(f"{source}:Env").__name__ == "Env"
    assert environment_class("scalerl.rollout.agent.environment:ChatEnvironment").__name__ == "ChatEnvironment"
    for spec, message in [(f"{source}:Missing", "has no class Missing"), (f"{source}:NoStep", "has no step method"),
                          (f"{tmp_path}/absent.py:Env", "not found"), ("Env", "module:Class"),
                          ("no_such_module_xyz:Env", "importing no_such_module_xyz failed: ModuleNotFoundError")]:
        with pytest.raises(UserError, match=message):
            environment_class(spec)


def test_the_tool_environment_runs_calls_and_answers_errors_to_the_model():
    env = ToolEnvironment([tool_from_function(op), tool_from_function(slow, timeout_s=0.2)], max_calls_per_turn=2)
    messages, tools = env.reset({"prompt": "3@4="})
    assert messages == [{"role": "user", "content": "3@4="}] and [t["function"]["name"] for t in tools] == ["op", "slow"]
    step = _step(env, 'x <tool_call>{"name": "op", "arguments": {"a": 3, "b": 4}}</tool_call>')
    assert step.messages == [{"role": "tool", "content": "1"}] and not step.done
    errors = _step(env, '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad json</tool_call>'
                        '<tool_call>{"name": "op", "arguments": {"a": "3", "b": 4}}</tool_call>')
    texts = [m["content"] for m in errors.messages]
    assert any("unknown tool 'nope'" in t for t in texts) and len(texts) == 3  # the bad JSON, the unknown, bad args
    late = _step(env, '<tool_call>{"name": "slow", "arguments": {"seconds": 1.5}}</tool_call>')
    assert late.info["seconds"] < 1.0 and late.info["tool_timeouts"] == 1
    assert _step(env, "the answer is 1").done  # no call: the episode is over
    assert env.stats["tool_calls"] == 4 and env.stats["tool_errors"] >= 3


def test_a_tool_episode_end_to_end_keeps_the_tool_result_as_untrained_context():
    model = tiny_model(vocab_size=128).eval()
    script = ScriptedTurns(2, '<tool_call>{"name": "op", "arguments": {"a": 3, "b": 4}}</tool_call>', "=1")
    engine = BuiltinEngine(model, TOK.pad_token_id, logits_processor=script).continuous_engine(256, 96, 4)
    loop = AgentLoop(engine, TOK, lambda: ToolEnvironment([tool_from_function(op)]), AgentLimits(max_turns=4,
                                                                                                  max_total_tokens=256))
    sampling = SamplingParams(max_new_tokens=96, seed=0, stop_token_ids=TOK.stop_token_ids)
    trajectories, records = loop.run([{"prompt": "3@4="}, {"prompt": "3@4="}], sampling)
    for t, r in zip(trajectories, records):
        generated, tool, answer = t.segments
        assert TOK.decode(generated.token_ids).endswith("</tool_call>") and generated.generated
        assert TOK.decode(tool.token_ids) == "1" and not tool.generated  # the built-in template: contents joined
        assert TOK.decode(answer.token_ids) == "=1" and r.end == "done" and r.info["tool_calls"] == 1
    assert agent_metrics(records, trajectories, 1.0)["agent/tool_calls"] == 2
