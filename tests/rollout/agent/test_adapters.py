"""Agents written for TRL and verl, run as they are: a TRL environment class from its own file (its methods the
tools, reset's text appended to the prompt, get_reward the episode's reward, instances reused), TRL's tool
functions, and verl's tool config YAML with BaseTool-shaped classes (one instance per trajectory, created,
executed, scored by calc_reward and released, errors included), verl's @function_tool files (loaded with and
without verl, the same schemas); bad inputs refused with the thing and the fix."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from types import SimpleNamespace

import pytest

from scalerl.core.errors import UserError
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.adapters import (
    TrlEnvironment,
    function_tools_as_tools,
    load_function_tools,
    tools_from_verl_config,
    trl_environment_factory,
    trl_reset_kwargs,
)
from scalerl.rollout.agent.environment import (
    ToolEnvironment,
    environment_class,
    is_trl_environment,
)
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop
from scalerl.rollout.agent.source import environment_factory
from scalerl.rollout.agent.tools import (
    ToolDefinitionError,
    call_tool,
    tools_from_module,
)
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.rollout.agent.conftest import ScriptedTurns
from tests.tiny import tiny_model

TOK = CharTokenizer()
SAMPLING = SamplingParams(max_new_tokens=96, seed=0, stop_token_ids=TOK.stop_token_ids)
LIMITS = AgentLimits(max_turns=4, max_total_tokens=256)

# A user's TRL environment file as TRL's GRPOTrainer docs write one (IncrementEnv), the target from the row.
TRL_ENV_FILE = '''
class IncrementEnv:
    built = 0

    def __init__(self):
        IncrementEnv.built += 1

    def reset(self, target, **kwargs) -> str | None:
        self.counter = 0
        self.target = int(target)
        self.seen_prompt = kwargs.get("prompt")
        return f" Reach {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''


def _call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _run(make_env, rows, first, limits=LIMITS):
    engine = BuiltinEngine(tiny_model(vocab_size=128).eval(), TOK.pad_token_id,
                           logits_processor=ScriptedTurns(len(rows), first)).continuous_engine(256, 96, 4)
    return AgentLoop(engine, TOK, make_env, limits).run(rows, SAMPLING)


def _agent_cfg(env: str, tools: str | None = None, **keys) -> SimpleNamespace:
    return SimpleNamespace(**{"env": env, "tools": tools, "tool_parser": "hermes", "system": None,
                              "max_tool_calls_per_turn": 4, "sandbox": None, "tool_config": None,
                              "function_tool_path": None, "interaction_config": None, **keys})


# ---- TRL -------------------------------------------------------------------------------------------------------

def test_a_trl_environment_file_runs_unchanged_from_the_config_line(tmp_path):
    source = tmp_path / "my_trl_env.py"
    source.write_text(TRL_ENV_FILE)
    cls = environment_class(f"{source}:IncrementEnv")  # no step method: accepted as TRL's shape
    assert is_trl_environment(cls)
    make_env = environment_factory(_agent_cfg(f"{source}:IncrementEnv"))
    # TRL rows: the prompt, the other columns under "columns" (what scalerl's TRL format makes of a file)
    rows = [{"prompt": "Count.", "columns": {"target": 3}}, {"prompt": "Count.", "columns": {"target": 5}}]
    trajectories, records = _run(make_env, rows, _call("increment", step=3))
    for t, r, target in zip(trajectories, records, (3, 5)):
        assert t.prompt_ids == TOK.encode(f"Count. Reach {target}.")  # reset's text appended to the prompt
        call, result, answer = t.segments
        assert call.generated and TOK.decode(call.token_ids).startswith("<tool_call>")
        assert result.token_ids == TOK.encode("3") and not result.generated  # the bound method's answer
        assert TOK.decode(answer.token_ids) == "ok" and r.end == "done" and r.info["tool_calls"] == 1
    assert [r.reward for r in records] == [1.0, 0.0]  # get_reward: counter == target
    assert [t.reward_inputs["env_reward"] for t in trajectories] == [1.0, 0.0]
    _, again = _run(make_env, rows, _call("increment", step=3))
    assert [r.reward for r in again] == [1.0, 0.0]  # reset again: the reused instances start over
    built = type(make_env().instance).built  # the class the config line loaded (another module than cls's)
    assert built == 2  # the probe and one more, reused by the next batch as TRL pools them


def test_trl_environment_offers_its_public_methods_as_tools_with_schemas():
    class Game:
        def reset(self, **kwargs):
            return None

        def get_reward(self) -> float:
            return 0.0

        def _helper(self):
            return 1

        @property
        def state(self):
            raise AssertionError("a property is not a tool and is never read to find the tools")

        async def move(self, direction: str) -> str:
            """Move one square.

            Args:
                direction: up, down, left or right.
            """
            return direction

    make_env = trl_environment_factory(Game)
    env = make_env()
    messages, schemas = asyncio.run(env.reset({"prompt": "Play."}))
    assert messages == [{"role": "user", "content": "Play."}]  # None: the prompt as it is
    assert schemas == [{"type": "function", "function": {
        "name": "move", "description": "Move one square.",
        "parameters": {"type": "object", "properties": {"direction": {"type": "string",
                                                                       "description": "up, down, left or right."}},
                       "required": ["direction"]}}}]
    result = asyncio.run(call_tool(env.tools["move"], {"direction": "up"}))
    assert result.content == "up" and not result.error


def test_trl_reset_gets_every_column_and_the_prompt():
    assert trl_reset_kwargs({"prompt": "p", "response": "r", "columns": {"target": 3, "id": 1}}) == {
        "prompt": "p", "target": 3, "id": 1}
    assert trl_reset_kwargs({"prompt": "p", "ground_truth": "4"}) == {"prompt": "p", "ground_truth": "4"}


def test_trl_environment_errors_name_the_class_the_method_and_the_fix(tmp_path):
    class NoDoc:
        def reset(self, **kwargs):
            return "go"

        def shout(self, text: str) -> str:
            return text.upper()

    with pytest.raises(ToolDefinitionError, match=r"TRL environment NoDoc: method shout\(\) has no docstring.*"
                                                  r"rename it _shout"):
        trl_environment_factory(NoDoc)

    class NoHint:
        def reset(self, **kwargs):
            return "go"

        def shout(self, text):
            """Shout.

            Args:
                text: what to shout
            """

    with pytest.raises(ToolDefinitionError, match="TRL environment NoHint: tool shout: argument 'text' has no type"):
        trl_environment_factory(NoHint)

    class Broken:
        def __init__(self):
            raise OSError("no server")

        def reset(self, **kwargs):
            return None

    with pytest.raises(UserError, match=r"Broken\(\): building it failed \(OSError: no server\).*no arguments"):
        trl_environment_factory(Broken)

    class ListReset:
        def reset(self, **kwargs):
            return [{"type": "text", "text": "hi"}]

    class NothingToSay:
        def reset(self, **kwargs):
            return None

    class TextReward:
        def reset(self, **kwargs):
            return "go"

        def get_reward(self):
            return "high"

    _, records = _run(trl_environment_factory(ListReset), [{"prompt": "x"}], "done")
    assert records[0].end == "env_error"
    assert "ListReset.reset returned list: return the first observation as a string" in records[0].info["error"]
    _, records = _run(trl_environment_factory(NothingToSay), [{"prompt": ""}], "done")
    assert "NothingToSay.reset returned None and the row has no prompt" in records[0].info["error"]
    _, records = _run(trl_environment_factory(TextReward), [{"prompt": "x"}], "done")
    assert records[0].end == "env_error"
    assert "TextReward.get_reward returned str: return a float" in records[0].info["error"]

    source = tmp_path / "env.py"
    source.write_text("class NoStep:\n    def reset(self, row):\n        return []\n")
    with pytest.raises(UserError, match="has no step method.*a TRL environment has reset\\(\\*\\*kwargs\\)"):
        environment_class(f"{source}:NoStep")  # reset(row) without **kwargs: not TRL's shape


def test_an_environment_that_owns_its_data_gets_its_text_as_the_user_message():
    class SelfSampled:
        def reset(self, **kwargs):
            return "What is 2+2?"

    env = trl_environment_factory(SelfSampled)()
    env.system = "Be brief."
    messages, schemas = asyncio.run(env.reset({"prompt": []}))
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert schemas == []


def test_trl_tool_functions_with_google_docstrings_work_as_rollout_agent_tools(tmp_path):
    source = tmp_path / "trl_tools.py"
    source.write_text(textwrap.dedent('''
        def multiply(a: int, b: int) -> int:
            """
            Multiplies two integers.

            Args:
                a: The first integer.
                b: The second integer.

            Returns:
                The product of the two integers.
            """
            return a * b

        async def async_add(a: int, b: int) -> int:
            """
            Asynchronously adds two integers.

            Args:
                a: The first integer.
                b: The second integer.

            Returns:
                The sum of the two integers.
            """
            return a + b
    '''))
    tools = tools_from_module(f"{source}:multiply,async_add")
    integers = {"a": {"type": "integer", "description": "The first integer."},
                "b": {"type": "integer", "description": "The second integer."}}
    assert [t.schema() for t in tools] == [
        {"type": "function", "function": {"name": "multiply", "description": "Multiplies two integers.",
                                          "parameters": {"type": "object", "properties": integers,
                                                         "required": ["a", "b"]}}},
        {"type": "function", "function": {"name": "async_add", "description": "Asynchronously adds two integers.",
                                          "parameters": {"type": "object", "properties": integers,
                                                         "required": ["a", "b"]}}}]
    env = ToolEnvironment(tools)
    env.reset({"prompt": "x"})
    step = asyncio.run(env.step({"role": "assistant", "content": _call("async_add", a=2, b=3)
                                 + _call("multiply", a=2, b=3)}))
    assert [m["content"] for m in step.messages] == ["5", "6"]


# ---- verl ------------------------------------------------------------------------------------------------------

# A user's verl tool module, subclassing verl's BaseTool (the stand-in's, verl_stand_in.py: verl itself is not
# installed), the tool shaped as verl's Gsm8kTool.
VERL_TOOL_MODULE = '''
import asyncio
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

EVENTS = []


class AnswerTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        EVENTS.append(("create", instance_id, ground_truth))
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        answer = str(parameters.get("answer", ""))
        if self.config.get("slow_s"):
            await asyncio.sleep(self.config["slow_s"])
        self._instance_dict[instance_id]["response"] = answer
        EVENTS.append(("execute", instance_id, answer))
        return ToolResponse(text=f"got {answer}"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        state = self._instance_dict[instance_id]
        return float(state["response"] == state["ground_truth"])

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", instance_id))
        del self._instance_dict[instance_id]


class NoScoreTool(BaseTool):
    pass
'''

ANSWER_SCHEMA = '''
    tool_schema:
      type: "function"
      function:
        name: "answer"
        description: "Submit the answer"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The answer, digits only"
          required: ["answer"]
'''


@pytest.fixture
def verl_tools(tmp_path, stand_in_verl):
    """The module above as ``user_verl_tools`` beside a tool config naming it verl's way (pkg.module.Class);
    neither is on sys.path: the YAML's directory is searched."""
    (tmp_path / "user_verl_tools.py").write_text(VERL_TOOL_MODULE)

    def config(body: str, name: str = "tool_config.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return path

    yield config
    sys.modules.pop("user_verl_tools", None)


ANSWER_CONFIG = '''
tools:
  - class_name: "user_verl_tools.AnswerTool"
    config:
      type: native
''' + ANSWER_SCHEMA


def _verl_env(tools):
    return lambda: ToolEnvironment(tools)


def test_a_verl_tool_config_runs_unchanged_one_instance_per_trajectory(verl_tools):
    tools = tools_from_verl_config(verl_tools(ANSWER_CONFIG))
    assert [t.schema() for t in tools] == [{"type": "function", "function": {
        "name": "answer", "description": "Submit the answer",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string",
                                                                    "description": "The answer, digits only"}},
                       "required": ["answer"]}}}]
    events = sys.modules["user_verl_tools"].EVENTS
    # verl rows: the tool's create_kwargs under extra_info.tools_kwargs, as verl's preprocessing writes them
    rows = [{"prompt": f"3+4=? ({i})", "extra_info": {"tools_kwargs": {"answer": {"create_kwargs": {
        "ground_truth": truth}}}}} for i, truth in enumerate(("7", "8"))]
    trajectories, records = _run(_verl_env(tools), rows, _call("answer", answer="7"))
    for t in trajectories:
        call, result, answer = t.segments
        assert call.generated and result.token_ids == TOK.encode("got 7") and not result.generated
        assert TOK.decode(answer.token_ids) == "ok"
    assert [r.reward for r in records] == [1.0, 0.0]  # calc_reward against each row's own ground truth
    created = {e[1]: e[2] for e in events if e[0] == "create"}
    assert sorted(created.values()) == ["7", "8"]  # one instance per trajectory, with its row's create_kwargs
    for instance in created:
        mine = [e[0] for e in events if e[1] == instance]
        assert mine == ["create", "execute", "release"]  # released once, at the end
    assert sys.modules["user_verl_tools"].AnswerTool.__name__ == "AnswerTool"


def test_the_config_key_rollout_agent_tool_config_loads_the_yaml(verl_tools):
    """rollout.agent.tool_config through the config and `environment_factory`, as a run builds it; the key
    without env=tools, and env=tools with nothing to call, are refused naming the keys."""
    from scalerl.core.config import ConfigError, load_config

    path = verl_tools(ANSWER_CONFIG)
    cfg = load_config(None, ["rollout.agent.env=tools", f"rollout.agent.tool_config={path}"])
    env = environment_factory(cfg.rollout.agent)()
    _, schemas = env.reset({"prompt": "3+4=?"})
    assert [s["function"]["name"] for s in schemas] == ["answer"]
    with pytest.raises(ConfigError, match=r"rollout.agent.tool_config=.* is read with rollout.agent.env=tools"):
        load_config(None, [f"rollout.agent.tool_config={path}"])
    with pytest.raises(ConfigError, match=r"rollout.agent.env=tools needs rollout.agent.tools .*tool_config"):
        load_config(None, ["rollout.agent.env=tools"])


def test_a_verl_instance_is_released_when_the_episode_fails(verl_tools):
    slow = ANSWER_CONFIG.replace("type: native", "type: native\n      slow_s: 30")
    tools = tools_from_verl_config(verl_tools(slow))
    events = sys.modules["user_verl_tools"].EVENTS
    rows = [{"prompt": "3+4=?", "tools_kwargs": {"answer": {"create_kwargs": {"ground_truth": "7"}}}}]
    _, records = _run(_verl_env(tools), rows, _call("answer", answer="7"),
                      AgentLimits(max_turns=4, max_total_tokens=256, env_timeout_s=0.5))
    assert records[0].end == "env_error" and "ToolEnvironment.step raised at turn 1: TimeoutError" in \
        records[0].info["error"]
    assert [e[0] for e in events] == ["create", "release"]  # the execute never finished; the instance is freed


def test_a_verl_tool_the_model_never_called_is_still_scored_and_released(verl_tools):
    tools = tools_from_verl_config(verl_tools(ANSWER_CONFIG))
    events = sys.modules["user_verl_tools"].EVENTS
    env = ToolEnvironment(tools)

    async def episode():
        env.reset({"prompt": "x", "tools_kwargs": {"answer": {"create_kwargs": {"ground_truth": "7"}}}})
        step = await env.step({"role": "assistant", "content": "no call"})
        reward = await env.episode_reward()
        await env.close()
        return step, reward

    step, reward = asyncio.run(episode())
    assert step.done and reward == 0.0  # scored as verl scored every tool of a request: nothing submitted
    assert [e[0] for e in events] == ["create", "release"]
    assert asyncio.run(call_tool(tools[0], {"answer": "5"})).content == "got 5"  # alone: an instance per call
    assert [e[0] for e in events[2:]] == ["create", "execute", "release"]


def test_a_tool_inheriting_verls_base_calc_reward_does_not_score(verl_tools, tmp_path):
    # verl's BaseTool.calc_reward always returns 0.0: taken as the reward it would zero every episode
    (tmp_path / "uses_verl_base.py").write_text("from verl.tools.base_tool import BaseTool\n\n"
                                               "class PlainTool(BaseTool):\n    pass\n")
    try:
        config = verl_tools(ANSWER_CONFIG.replace("user_verl_tools.AnswerTool", "uses_verl_base.PlainTool"))
        plain = tools_from_verl_config(config)
        own = tools_from_verl_config(verl_tools(ANSWER_CONFIG, "own.yaml"))
        assert [plain[0].scores, own[0].scores] == [False, True]
        env = ToolEnvironment(plain)
        env.reset({"prompt": "x"})
        assert asyncio.run(env.episode_reward()) is None  # the run's reward function scores these episodes
    finally:
        sys.modules.pop("uses_verl_base", None)


def test_verl_tool_config_errors_name_the_entry_and_the_fix(verl_tools):
    cases = [
        ("tools: []\n", "has no `tools:` list; verl's shape is"),
        ("actor: {}\n", "has no `tools:` list"),
        (ANSWER_CONFIG.replace("AnswerTool", "NoSuchTool"),
         r"tools\[0\]: class_name 'user_verl_tools.NoSuchTool': module user_verl_tools has no class NoSuchTool"),
        (ANSWER_CONFIG.replace("user_verl_tools.AnswerTool", "no_such_package_xyz.Tool"),
         "importing no_such_package_xyz failed .*ModuleNotFoundError.*PYTHONPATH"),
        (ANSWER_CONFIG.replace("user_verl_tools.AnswerTool", "AnswerTool"), "names no module"),
        (ANSWER_CONFIG.replace("type: native", "type: mcp"), "config.type 'mcp' is not supported"),
        (ANSWER_CONFIG.split("    tool_schema:")[0], "AnswerTool\\(config=..., tool_schema=...\\) raised AttributeError"),
        (ANSWER_CONFIG + ANSWER_CONFIG.split("tools:\n")[1], r"tools\[1\]: a second tool named 'answer'"),
    ]
    for body, message in cases:
        with pytest.raises(ToolDefinitionError, match=message):
            tools_from_verl_config(verl_tools(body))
    with pytest.raises(ToolDefinitionError, match="no such file"):
        tools_from_verl_config("/nonexistent/tool_config.yaml")


def test_trl_environment_with_standalone_verl_tools_sums_both_rewards(verl_tools):
    class Env:
        def reset(self, **kwargs):
            return None

        def get_reward(self) -> float:
            return 0.5

    make_env = trl_environment_factory(Env, tools_from_verl_config(verl_tools(ANSWER_CONFIG)))
    rows = [{"prompt": "3+4=?", "tools_kwargs": {"answer": {"create_kwargs": {"ground_truth": "7"}}}}]
    _, records = _run(make_env, rows, _call("answer", answer="7"))
    assert isinstance(make_env(), TrlEnvironment) and records[0].reward == 1.5


def test_a_trl_environment_trains_from_the_config_line_its_get_reward_the_score(tiny_config, length_reward, tmp_path):
    from scalerl.trainer.rl_trainer import RLTrainer

    env = tmp_path / "trl_env.py"
    env.write_text("class Scored:\n"
                   "    def reset(self, **kwargs):\n        self.prompt = kwargs['prompt']\n"
                   "    def get_reward(self) -> float:\n        return len(self.prompt) / 100\n")
    trainer = RLTrainer.from_config(tiny_config("trainer.total_steps=1", f"rollout.agent.env={env}:Scored",
                                                length_reward, f"trainer.output_dir={tmp_path}/trl"))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    batch = batches[0]
    width = batch.input_ids.shape[1] - batch.response_ids.shape[1]
    prompts = trainer.tokenizer.batch_decode(batch.input_ids[:, :width].tolist())  # pads skipped
    # get_reward scored every episode, in place of the run's length reward
    assert batch.scores.tolist() == pytest.approx([len(p) / 100 for p in prompts])


def test_the_examples_run_as_their_docs_say():
    from pathlib import Path

    examples = Path(__file__).resolve().parents[3] / "examples" / "agents"
    make_env = environment_factory(_agent_cfg(f"{examples}/trl_calculator_env.py:CalculatorEnv"))
    env = make_env()
    assert isinstance(env, TrlEnvironment) and sorted(env.tools) == ["add", "submit"]

    async def trl_episode():
        messages, _ = await env.reset({"prompt": "12+7=", "ground_truth": "19"})
        step = await env.step({"role": "assistant", "content": _call("add", a=12, b=7) + _call("submit", answer=19)})
        return messages, step, await env.episode_reward()

    messages, step, reward = asyncio.run(trl_episode())
    assert messages == [{"role": "user", "content": "12+7= Use the tools: add, then submit the result."}]
    assert [m["content"] for m in step.messages] == ["19", "submitted 19"] and reward == 1.0

    try:
        tools = tools_from_verl_config(examples / "verl_tool_config.yml")
        verl_env = ToolEnvironment(tools)

        async def verl_episode():
            verl_env.reset({"prompt": "12+7=", "extra_info": {"tools_kwargs": {"submit_answer": {
                "create_kwargs": {"ground_truth": "19"}}}}})
            step = await verl_env.step({"role": "assistant", "content": _call("submit_answer", answer="19")})
            reward = await verl_env.episode_reward()
            await verl_env.close()
            return step, reward

        step, reward = asyncio.run(verl_episode())
        assert step.messages == [{"role": "tool", "content": "received 19"}] and reward == 1.0
        assert tools[0].base_tool._instance_dict == {}  # released
    finally:
        sys.modules.pop("verl_answer_tool", None)


# ---- verl: @function_tool files ---------------------------------------------------------------------------------

# A user's verl function tool file (verl's multi_turn.function_tool_path), the decorator's three forms, plain and
# async functions, and the returns verl renders (a dict as JSON, a (response, reward, metrics) tuple).
FUNCTION_TOOLS_FILE = '''
import asyncio

from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> dict:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return {"sum": a + b}


@function_tool("lookup")
async def find_capital(country: str) -> str:
    """Look up a country's capital.

    Args:
        country: The country's English name.
    """
    await asyncio.sleep(0)
    return {"France": "Paris"}.get(country, "unknown")


@function_tool(schema={"type": "function", "function": {"name": "shout", "description": "Shout the text.",
               "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}})
def shout(text):
    return text.upper(), 1.0, {"chars": len(text)}


def helper(x):  # not decorated: not a tool
    return x
'''
ADD_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first addend."},
                                                    "b": {"type": "integer", "description": "The second addend."}},
                   "required": ["a", "b"]}}}


def test_a_function_tool_file_loads_without_verl_its_schemas_as_verl_infers_them(tmp_path, monkeypatch):
    """No verl installed: the file's ``from verl.tools.function_tool import function_tool`` finds scalerl's
    stand-in for the load only; with verl (its loader and transformers' get_json_schema, the stand-in of
    verl_stand_in.py here) the same file gives the same tools."""
    from tests.rollout.agent import verl_stand_in
    from tests.rollout.agent.conftest import forget_modules

    path = tmp_path / "fns.py"
    path.write_text(FUNCTION_TOOLS_FILE)
    forget_modules("verl")
    tools = function_tools_as_tools(path)
    assert "verl" not in sys.modules and "verl.tools.function_tool" not in sys.modules  # nothing left behind
    assert [t.name for t in tools] == ["add", "lookup", "shout"]  # verl's order; helper is no tool
    assert tools[0].schema() == ADD_SCHEMA
    assert tools[1].schema()["function"]["description"] == "Look up a country's capital."
    assert tools[2].parameters == {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    results = [asyncio.run(call_tool(t, arguments)).content for t, arguments in
               zip(tools, ({"a": 2, "b": 3}, {"country": "France"}, {"text": "hi"}))]
    assert results == ['{"sum": 5}', "Paris", "HI"]  # verl's rendering: a dict as JSON, a tuple's response
    assert asyncio.run(call_tool(tools[0], {"a": "two", "b": 3})).error  # checked against the schema first

    verl_stand_in.install(tmp_path / "stand_in")
    monkeypatch.syspath_prepend(str(tmp_path / "stand_in"))
    try:
        entries = load_function_tools(path)
        assert {type(e).__module__ for e in entries} == {"verl.tools.function_tool"}  # verl's own loader ran
        with_verl = function_tools_as_tools(path)
        assert [t.schema() for t in with_verl] == [t.schema() for t in tools]
        assert asyncio.run(call_tool(with_verl[0], {"a": 2, "b": 3})).content == '{"sum": 5}'
    finally:
        forget_modules("verl")


def test_function_tools_run_from_the_config_line_beside_a_verl_tool_config(verl_tools, tmp_path):
    """rollout.agent.function_tool_path through the config and `environment_factory`: the model's call runs the
    function and its answer is the tool message; a name both files declare is refused naming both."""
    from scalerl.core.config import ConfigError, load_config

    path = tmp_path / "fns.py"
    path.write_text(FUNCTION_TOOLS_FILE)
    cfg = load_config(None, ["rollout.agent.env=tools", f"rollout.agent.function_tool_path={path}",
                             f"rollout.agent.tool_config={verl_tools(ANSWER_CONFIG)}"])
    make_env = environment_factory(cfg.rollout.agent)
    assert sorted(make_env().tools) == ["add", "answer", "lookup", "shout"]
    trajectories, records = _run(make_env, [{"prompt": "2+3=?"}], _call("add", a=2, b=3))
    call, result, answer = trajectories[0].segments
    assert call.generated and not result.generated and TOK.decode(result.token_ids) == '{"sum": 5}'
    assert answer.generated and records[0].info["tool_calls"] == 1
    clash = verl_tools(ANSWER_CONFIG.replace('name: "answer"', 'name: "add"'), "clash.yaml")
    with pytest.raises(ToolDefinitionError, match=r"tool name 'add' is declared by .*tool_config and by "
                                                  r"rollout.agent.function_tool_path="):
        environment_factory(_agent_cfg("tools", tool_config=str(clash), function_tool_path=str(path)))
    with pytest.raises(ConfigError, match="rollout.agent.function_tool_path=.* is read with rollout.agent.env=tools"):
        load_config(None, [f"rollout.agent.function_tool_path={path}"])


def test_function_tool_file_errors_name_the_file_and_the_fix(tmp_path):
    decorated = "from verl.tools.function_tool import function_tool\n\n@function_tool\n"
    cases = {
        "none.py": ("def add(a: int) -> int:\n    return a\n",
                    "it registers no tool; decorate each tool function with verl's @function_tool"),
        "variadic.py": (decorated + "def add(*numbers: int) -> int:\n    return sum(numbers)\n",
                        r"running it raised ValueError: @function_tool 'add' .* takes \*args / \*\*kwargs \(numbers\)"),
        "untyped.py": (decorated + "def add(a):\n    return a\n", "tool add: argument 'a' has no type hint"),
        "broken.py": ("import no_such_module_xyz\n",
                      "running it raised ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ToolDefinitionError, match=f"function tool file {tmp_path / name}: {message}"):
            load_function_tools(tmp_path / name)
    with pytest.raises(ToolDefinitionError, match="function tool file nope.py: no such file"):
        load_function_tools("nope.py")


def test_the_function_tool_example_runs_as_its_docs_say():
    from pathlib import Path

    from tests.rollout.agent.conftest import forget_modules

    examples = Path(__file__).resolve().parents[3] / "examples" / "agents"
    forget_modules("verl")
    make_env = environment_factory(_agent_cfg("tools", function_tool_path=str(examples / "verl_function_tools.py")))
    env = make_env()
    assert sorted(env.tools) == ["add", "multiply"]
    env.reset({"prompt": "6*7="})
    step = asyncio.run(env.step({"role": "assistant", "content": _call("multiply", a=6, b=7) + _call("add", a=1, b=2)}))
    assert [m["content"] for m in step.messages] == ["42", '{"sum": 3}']
