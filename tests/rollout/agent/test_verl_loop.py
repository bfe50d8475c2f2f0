"""verl agent loops run as their authors wrote them: an ``AgentLoopBase`` subclass (written against verl's
modules: the stand-in in verl_stand_in.py where verl is not installed, verl itself where it is) with its tools
from a verl tool config YAML, picked per row by ``agent_name``, its turns sampled by scalerl's engine through
the server-manager shim, its output held token for token to what the engine sampled (sampled tokens it masks 0
kept with their log-probs, out of the loss; its own stop tokens reaching the engine; verl's function tools handed
in); it trains from the config line. Bad loops and specs are refused naming the loop and the fix."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop
from scalerl.rollout.agent.tools import ToolDefinitionError
from scalerl.rollout.agent.verl_loop import (
    VerlLoopError,
    VerlLoops,
    episode_from_output,
    verl_loop_factory,
    verl_run_kwargs,
)
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import TrajectorySegment
from tests.rollout.agent.conftest import ScriptedTurns, forget_modules
from tests.tiny import tiny_model

TOK = CharTokenizer()
SAMPLING = SamplingParams(max_new_tokens=96, seed=0, stop_token_ids=TOK.stop_token_ids)
LIMITS = AgentLimits(max_turns=4, max_total_tokens=256)

# A user's verl tool (verl's Gsm8kTool shape, subclassing BaseTool) and its tool config, as verl reads them.
USER_TOOLS = '''
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

EVENTS = []


class AnswerTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instance_dict[instance_id] = {"answer": "", "ground_truth": truth}
        EVENTS.append(("create", truth))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        answer = str(parameters.get("answer", ""))
        self._instance_dict[instance_id]["answer"] = answer
        return ToolResponse(text=f"got {len(answer)}"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        state = self._instance_dict[instance_id]
        if state["ground_truth"] is None:  # graded by length: varies for an untrained model
            return min(len(state["answer"]), 10) / 10
        return float(state["answer"] == str(state["ground_truth"]))

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", self._instance_dict.pop(instance_id)["answer"]))
'''
TOOL_CONFIG = '''
tools:
  - class_name: "user_verl_tools.AnswerTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "submit_answer"
        description: "Submit the final answer."
        parameters:
          type: "object"
          properties:
            answer: {type: "string", description: "The answer."}
          required: ["answer"]
'''
# The user's agent loops, written against verl's interfaces: a tool loop in the shape of verl's ToolAgentLoop
# (its config keys, tool registry, Hermes parser, apply_chat_template for the tool turn), and one that always
# hands the model's answer to the tool (multi-turn whatever an untrained model writes). TRACE keeps every
# TokenOutput the server manager returned, with the loop's output, for the tests to compare.
USER_LOOPS = '''
import json
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.utils.tool_registry import initialize_tools_from_config

TRACE = []


class _ToolLoop(AgentLoopBase):
    def __init__(self, trainer_config, server_manager, tokenizer, processor, **kwargs):
        super().__init__(trainer_config, server_manager, tokenizer, processor, **kwargs)
        multi_turn = self.config.actor_rollout_ref.rollout.multi_turn
        self.max_assistant_turns = multi_turn.max_assistant_turns
        self.response_length = self.config.actor_rollout_ref.rollout.response_length
        tools = initialize_tools_from_config(multi_turn.tool_config_path)
        self.tools = {tool.name: tool for tool in tools}
        self.tool_schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools]
        self.tool_parser = ToolParser.get_tool_parser(multi_turn.format, self.tokenizer)
        self.suffix = kwargs.get("suffix", "")

    async def calls(self, token_ids):
        _, calls = await self.tool_parser.extract_tool_calls(token_ids)
        return [(c.name, json.loads(c.arguments)) for c in calls]

    async def run(self, sampling_params, **kwargs):
        messages = list(kwargs["raw_prompt"])
        tools_kwargs = kwargs.get("tools_kwargs", {})
        request_id = uuid4().hex
        prompt_ids = await self.apply_chat_template(messages, tools=self.tool_schemas)
        ids, mask, logprobs, outputs, rewards = list(prompt_ids), [], [], [], []
        while True:
            out = await self.server_manager.generate(request_id, prompt_ids=ids, sampling_params=sampling_params)
            outputs.append(out)
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += out.log_probs
            if len(mask) >= self.response_length or len(outputs) >= self.max_assistant_turns:
                break
            calls = await self.calls(out.token_ids)
            if not calls:
                break
            replies = []
            for name, arguments in calls:
                tool = self.tools[name]
                instance_id, _ = await tool.create(create_kwargs=tools_kwargs.get(name, {}).get("create_kwargs", {}))
                response, _, _ = await tool.execute(instance_id, arguments)
                rewards.append(await tool.calc_reward(instance_id))
                await tool.release(instance_id)
                replies.append({"role": "tool", "content": response.text + self.suffix})
            tool_ids = await self.apply_chat_template(replies, remove_system_prompt=True)
            if len(mask) + len(tool_ids) >= self.response_length:
                break
            ids += tool_ids
            mask += [0] * len(tool_ids)
            logprobs += [0.0] * len(tool_ids)
        output = AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):][: self.response_length],
            response_mask=mask[: self.response_length], response_logprobs=logprobs[: self.response_length],
            reward_score=max(rewards) if rewards else None, num_turns=2 * len(outputs), metrics=AgentLoopMetrics(),
            extra_fields={"tool_rewards": rewards})
        TRACE.append((outputs, output))
        return output


@register("calc_agent")
class CalcAgentLoop(_ToolLoop):
    pass


@register("forced_tool_agent")
class ForcedToolLoop(_ToolLoop):
    async def calls(self, token_ids):
        if self.forced:
            return []
        self.forced = True
        return [("submit_answer", {"answer": self.tokenizer.decode(token_ids, skip_special_tokens=True)})]

    async def run(self, sampling_params, **kwargs):
        self.forced = False
        return await super().run(sampling_params, **kwargs)


@register("bad_lengths")
class BadLengths(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        out = await self.server_manager.generate("r", prompt_ids=prompt_ids, sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids, response_mask=[1],
                               response_logprobs=out.log_probs, metrics=AgentLoopMetrics())


@register("hot_sampler")
class HotSampler(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        await self.server_manager.generate("r", prompt_ids=prompt_ids,
                                           sampling_params={**sampling_params, "temperature": 0.5})
'''


# Loops that use the rest of verl's interface: a sampled draft kept in the conversation but masked out of the loss
# (response_mask 0 on tokens the engine sampled), a turn with a stop token of its own (stop_token_ids, as verl
# 0.9.1's tool parsers add theirs), stop strings (refused), and verl 0.9.1's function tools handed in (tools=).
MASK_AND_STOP_LOOPS = '''

@register("masked_draft")
class MaskedDraftLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        ids, mask, logprobs = list(prompt_ids), [], []
        draft = await self.server_manager.generate("r", prompt_ids=ids, sampling_params=sampling_params)
        ids, mask, logprobs = ids + draft.token_ids, [0] * len(draft.token_ids), list(draft.log_probs)
        nudge = await self.apply_chat_template([{"role": "user", "content": "again"}], remove_system_prompt=True)
        ids, mask, logprobs = ids + nudge, mask + [0] * len(nudge), logprobs + [0.0] * len(nudge)
        final = await self.server_manager.generate("r", prompt_ids=ids, sampling_params=sampling_params)
        ids, mask, logprobs = ids + final.token_ids, mask + [1] * len(final.token_ids), logprobs + final.log_probs
        output = AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):], response_mask=mask,
                                 response_logprobs=logprobs, num_turns=3, metrics=AgentLoopMetrics())
        TRACE.append(([draft, final], output))
        return output


@register("stop_at_bang")
class StopAtBang(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        stops = {**sampling_params, "stop_token_ids": self.tokenizer.encode("!")}
        out = await self.server_manager.generate("r", prompt_ids=prompt_ids, sampling_params=stops)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               response_logprobs=out.log_probs, metrics=AgentLoopMetrics())


@register("stop_strings")
class StopStrings(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        await self.server_manager.generate("r", prompt_ids=prompt_ids, sampling_params={**sampling_params,
                                                                                         "stop": ["</answer>"]})


@register("function_tool_agent")
class FunctionToolLoop(AgentLoopBase):
    def __init__(self, *args, tools=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = {tool.name: tool for tool in (tools.tools if tools else [])}

    async def run(self, sampling_params, **kwargs):
        from verl.tools.function_tool import FunctionTool, normalize_function_tool_return

        tool = self.tools["add"]
        assert isinstance(tool, FunctionTool), type(tool)  # verl 0.9.1's loop dispatches on the type
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]), tools=[
            t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in self.tools.values()])
        first = await self.server_manager.generate("r", prompt_ids=prompt_ids, sampling_params=sampling_params)
        response, _, _ = normalize_function_tool_return(await tool.call({"a": 2, "b": 3}))
        result = await self.apply_chat_template([{"role": "tool", "content": response.text}],
                                                remove_system_prompt=True)
        ids = prompt_ids + first.token_ids + result
        second = await self.server_manager.generate("r", prompt_ids=ids, sampling_params=sampling_params)
        ids += second.token_ids
        mask = [1] * len(first.token_ids) + [0] * len(result) + [1] * len(second.token_ids)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):], response_mask=mask,
                               metrics=AgentLoopMetrics())
'''


def _call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _real_verl_importable() -> bool:
    try:
        import verl.experimental.agent_loop.tool_agent_loop  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or installed without its dependencies
        return False
    return True


REAL_VERL = _real_verl_importable()


@pytest.fixture
def verl_files(tmp_path, monkeypatch, stand_in_verl):
    """The stand-in verl (v0.9's interface, the user's files are written to; also where verl 0.9.1 is installed),
    the user's tools and loops, and their tool config YAML; every module they load is forgotten after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_verl_tools.py").write_text(USER_TOOLS)
    (tmp_path / "user_verl_loops.py").write_text(USER_LOOPS + MASK_AND_STOP_LOOPS)
    (tmp_path / "tool_config.yaml").write_text(TOOL_CONFIG)
    yield tmp_path
    forget_modules("verl", "user_verl_tools", "user_verl_loops")


def _cfg(tmp_path, *overrides: str):
    return load_config(None, ["rollout.agent.env=verl", f"rollout.agent.tool_config={tmp_path}/tool_config.yaml",
                              "rollout.temperature=1.0", *overrides])


def _run(make_env, rows, first, limits=LIMITS, first_turns=None):
    """``first_turns``: the episodes whose first turn says ``first`` (all, unless some never generate)."""
    scripted = ScriptedTurns(len(rows) if first_turns is None else first_turns, first)
    engine = BuiltinEngine(tiny_model(vocab_size=128).eval(), TOK.pad_token_id,
                           logits_processor=scripted).continuous_engine(256, 96, 4)
    return AgentLoop(engine, TOK, make_env, limits).run(rows, SAMPLING)


def _verl_row(prompt: str, agent_name: str | None, truth: str | None = None, **extra) -> dict:
    """A row as scalerl's verl format reads one (verl's fields; every column but the prompt under columns)."""
    extra_info = {"index": 0, "tools_kwargs": {"submit_answer": {"create_kwargs": {"ground_truth": truth}}}, **extra}
    record = {"data_source": "test", "reward_model": {"ground_truth": truth}, "extra_info": extra_info}
    if agent_name is not None:
        record["agent_name"] = agent_name
    return {"prompt": [{"role": "user", "content": prompt}], "ground_truth": truth, "data_source": "test",
            "reward_model": record["reward_model"], "extra_info": extra_info, "columns": record}


def test_a_verl_tool_agent_loop_runs_unchanged_and_its_trajectory_is_what_the_engine_sampled(verl_files):
    make_env = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:CalcAgentLoop"), TOK,
                                 LIMITS)
    rows = [_verl_row("6+1=", "calc_agent", "7"), _verl_row("2+2=", "calc_agent", "4")]
    trajectories, records = _run(make_env, rows, _call("submit_answer", answer="7"))
    loops = sys.modules["user_verl_loops"]
    by_prompt = {tuple(output.prompt_ids): outputs for outputs, output in loops.TRACE}
    for t, r, reward in zip(trajectories, records, (1.0, 0.0)):
        assert r.end == "done" and "error" not in r.info, r.info
        assert t.prompt_ids == TOK.encode(t.reward_inputs["row"]["prompt"][0]["content"])  # the loop's own render
        call, result, answer = t.segments
        outputs = by_prompt[tuple(t.prompt_ids)]
        # the trained segments are the engine's turns, ids and log-probs, exactly as the shim handed them over
        assert [s.token_ids for s in (call, answer)] == [o.token_ids for o in outputs]
        assert [s.logprobs for s in (call, answer)] == [o.log_probs for o in outputs]
        assert call.generated and answer.generated and not result.generated
        assert TOK.decode(call.token_ids).startswith("<tool_call>") and TOK.decode(answer.token_ids) == "ok"
        assert result.token_ids == TOK.encode("got 1")  # the tool message, the loop's apply_chat_template
        assert r.reward == reward and t.reward_inputs["env_reward"] == reward  # reward_score: the loop's
        assert r.info["verl_num_turns"] == 4 and r.info["verl_extra_fields"] == {"tool_rewards": [reward]}
        assert r.info["verl_loop"] == "CalcAgentLoop (agent_name 'calc_agent')"
    events = sys.modules["user_verl_tools"].EVENTS
    assert sorted(events) == [("create", "4"), ("create", "7"), ("release", "7"), ("release", "7")]


def test_rows_pick_their_loop_by_agent_name_from_a_verl_agent_loop_config(verl_files):
    (verl_files / "agent_loops.yaml").write_text(textwrap.dedent("""\
        - name: calc_agent
          _target_: user_verl_loops.CalcAgentLoop
        - name: shouting_agent
          _target_: user_verl_loops.CalcAgentLoop
          suffix: "!"
        """))
    cfg = _cfg(verl_files, f"rollout.agent.verl_loop={verl_files}/agent_loops.yaml",
               "rollout.agent.verl_default_loop=shouting_agent")
    make_env = verl_loop_factory(cfg, TOK, LIMITS)
    rows = [_verl_row("6+1=", "calc_agent", "7"), _verl_row("6+1=", None, "7"),  # no agent_name: the default
            _verl_row("6+1=", "forced_tool_agent", "7"),  # not in the YAML: registered with @register
            _verl_row("6+1=", "no_such_agent", "7")]
    trajectories, records = _run(make_env, rows, _call("submit_answer", answer="7"), first_turns=3)
    results = [TOK.decode(t.segments[1].token_ids) if len(t.segments) > 1 else None for t in trajectories]
    assert results[:2] == ["got 1", "got 1!"]  # the YAML entry's constructor argument reached the loop
    assert records[2].info["verl_loop"] == "ForcedToolLoop (agent_name 'forced_tool_agent')"
    error = records[3].info["error"]
    assert records[3].end == "env_error" and "agent_name 'no_such_agent' names no verl agent loop here" in error
    assert "calc_agent, forced_tool_agent" in error and "@register('no_such_agent')" in error


def test_a_loop_returning_mismatched_lengths_is_an_error_naming_the_loop_and_the_lengths(verl_files):
    make_env = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:BadLengths"), TOK, LIMITS)
    trajectories, records = _run(make_env, [_verl_row("6+1=", None)], "12")
    assert records[0].end == "env_error" and not trajectories[0].segments[0].generated  # nothing trained
    assert ("verl agent loop BadLengths (agent_name 'bad_lengths') returned response_ids of 3 tokens, "
            "response_mask of 1, response_logprobs 3: give one mask value (and one log-prob) per response token"
            ) in records[0].info["error"]


def test_a_loop_asking_other_sampling_than_the_runs_is_refused(verl_files):
    make_env = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:HotSampler"), TOK, LIMITS)
    _, records = _run(make_env, [_verl_row("6+1=", None)], "12")
    assert ("verl agent loop HotSampler (agent_name 'hot_sampler') asked generate for temperature=0.5; scalerl "
            "samples every turn with the run's rollout.temperature=1.0") in records[0].info["error"]


def test_the_output_must_be_the_turns_the_engine_returned():
    turn1, turn2 = TrajectorySegment([5, 6], True, [-0.1, -0.2]), TrajectorySegment([7], True, [-0.3])
    calls = [([1, 2], turn1), ([1, 2, 5, 6, 9], turn2)]
    good = {"prompt_ids": [1, 2], "response_ids": [5, 6, 9, 7], "response_mask": [1, 1, 0, 1]}
    episode = episode_from_output("L", good, calls)
    assert episode.segments == [turn1, [9], turn2] and episode.segments[0] is turn1 and episode.reward is None
    for change, message in [
        ({"response_ids": [5, 8, 9, 7]}, "response tokens 0..1 are not the 2 tokens generate returned for turn 1"),
        ({"response_mask": [1, 1, 1, 1]}, "marks response token 2 as sampled, but it comes before turn 2"),
        ({"response_ids": [5, 6, 9], "response_mask": [1, 1, 0]}, "generate returned 2 turns and response_ids holds 1"),
        ({"response_ids": [5, 6, 9, 7, 4], "response_mask": [1, 1, 0, 1, 1]}, "marks response token 4 as sampled"),
        ({"response_mask": [1, 1, 2, 1]}, "response_mask holds [2]"),
        ({"response_logprobs": [0.0]}, "response_ids of 4 tokens, response_mask of 4, response_logprobs 1"),
        ({"response_mask": None}, "returned dict without response_mask; return verl's AgentLoopOutput"),
        ({"reward_score": "high"}, "reward_score is str; give a float or None"),
    ]:
        with pytest.raises(VerlLoopError, match="verl agent loop L") as caught:
            episode_from_output("L", {**good, **change}, calls)
        assert message in str(caught.value)


def test_each_turn_must_sit_where_it_was_sampled():
    turn1, turn2 = TrajectorySegment([5, 6], True, [-0.1, -0.2]), TrajectorySegment([7], True, [-0.3])
    good = {"prompt_ids": [1, 2], "response_ids": [5, 6, 9, 7], "response_mask": [1, 1, 0, 1]}
    with pytest.raises(VerlLoopError, match=r"turn 2 was sampled on a prompt of 5 tokens that is not prompt_ids \+ "
                                            r"the response before it \(they differ at token 4\)"):
        episode_from_output("L", good, [([1, 2], turn1), ([1, 2, 5, 6, 8], turn2)])  # a re-rendered tool answer
    redrawn = {"prompt_ids": [1, 2], "response_ids": [5, 6, 7], "response_mask": [1, 1, 1]}
    with pytest.raises(VerlLoopError, match="turn 2 was sampled on a prompt that ends before turn 1 does"):
        episode_from_output("L", redrawn, [([1, 2], turn1), ([1, 2], turn2)])  # turn 1 dropped and drawn again
    kept = {"prompt_ids": [1, 2], "response_ids": [5, 6, 9, 7], "response_mask": [0, 0, 0, 1]}
    episode = episode_from_output("L", kept, [([1, 2], turn1), ([1, 2, 5, 6, 9], turn2)])  # kept, masked 0
    assert episode.segments == [turn1, [9], turn2] and turn1.loss_mask == [0, 0] and turn2.loss_mask is None


def test_a_verl_row_reaches_run_as_verls_dataset_gives_it():
    row = _verl_row("6+1=", "calc_agent", "7", interaction_kwargs={"name": "judge"})
    name, kwargs = verl_run_kwargs(row)
    assert name == "calc_agent" and "agent_name" not in kwargs  # verl hands it to the worker, not to run
    assert kwargs["raw_prompt"] == [{"role": "user", "content": "6+1="}]
    assert kwargs["tools_kwargs"] == {"submit_answer": {"create_kwargs": {"ground_truth": "7"}}}
    assert kwargs["interaction_kwargs"] == {"name": "judge"} and kwargs["index"] == 0
    assert kwargs["data_source"] == "test" and kwargs["reward_model"] == {"ground_truth": "7"}


def test_bad_loop_specs_and_keys_are_refused_naming_the_fix(verl_files):
    with pytest.raises(ConfigError, match="rollout.agent.env=verl and rollout.agent.verl_loop go together"):
        load_config(None, ["rollout.agent.env=verl"])
    with pytest.raises(ConfigError, match="rollout.agent.env=verl and rollout.agent.verl_loop go together"):
        load_config(None, ["rollout.agent.verl_loop=pkg.Loop"])
    with pytest.raises(VerlLoopError, match="module user_verl_loops has no class NoSuchLoop"):
        VerlLoops("user_verl_loops:NoSuchLoop")
    (verl_files / "not_a_loop.py").write_text("class ToolLoop:\n    def run(self):\n        pass\n")
    with pytest.raises(VerlLoopError, match="ToolLoop has no async run"):
        VerlLoops(f"{verl_files}/not_a_loop.py:ToolLoop")
    (verl_files / "bad.yaml").write_text("- name: x\n")
    with pytest.raises(VerlLoopError, match="entry 0 needs a name and a _target_"):
        VerlLoops(str(verl_files / "bad.yaml"))
    (verl_files / "two.yaml").write_text("- {name: a, _target_: user_verl_loops.CalcAgentLoop}\n"
                                         "- {name: b, _target_: user_verl_loops.NoLoop}\n")
    loops = VerlLoops(str(verl_files / "two.yaml"))
    assert loops.resolve("a").cls.__name__ == "CalcAgentLoop"
    with pytest.raises(VerlLoopError, match="_target_ 'user_verl_loops.NoLoop': module user_verl_loops has no class"):
        loops.resolve("b")
    with pytest.raises(VerlLoopError, match="a row has no agent_name and rollout.agent.verl_default_loop is not set"):
        loops.resolve(None)


def test_a_verl_agent_loop_trains_from_the_config_line(tiny_config, length_reward, tmp_path, verl_files):
    """A few steps through the forced tool loop on verl-format rows: every trained row is the engine's turns
    and the tool's answer, masked as the loop masked them, the engine's log-probs in place, scored by the
    loop's reward_score (calc_reward of the verl tool)."""
    from scalerl.rollout.agent.source import AgentRollouts
    from scalerl.trainer.rl_trainer import RLTrainer

    data = tmp_path / "verl_rows.jsonl"
    data.write_text("".join(json.dumps({
        "data_source": "test", "prompt": [{"role": "user", "content": f"{a}+{a}="}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)}, "agent_name": "forced_tool_agent",
        "extra_info": {"index": a, "tools_kwargs": {}}}) + "\n" for a in range(1, 21)))
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=3", "rollout.agent.env=verl", "rollout.agent.verl_loop=user_verl_loops:ForcedToolLoop",
        f"rollout.agent.tool_config={verl_files}/tool_config.yaml", "data.format=verl",
        f"data.train_files=[{data}]", f"data.val_files=[{data}]", length_reward, f"trainer.output_dir={tmp_path}/v"))
    assert isinstance(trainer.rollouts, AgentRollouts)
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    trace = sys.modules["user_verl_loops"].TRACE
    assert len(batches) == 3  # (the trace also holds the evaluation's episodes: they run the same loop)
    for batch in batches:
        for i in range(len(batch)):
            length = int(batch.response_attention[i].sum())
            response = batch.response_ids[i, :length].tolist()
            outputs, output = next((o, out) for o, out in trace if out.response_ids == response)
            turn1, turn2 = outputs  # the model's answer, handed to the tool, then the turn after the tool's reply
            tool = response[len(turn1.token_ids): length - len(turn2.token_ids)]
            assert response == turn1.token_ids + tool + turn2.token_ids and TOK.decode(tool).startswith("got ")
            assert batch.response_mask[i, :length].tolist() == output.response_mask == (
                [1] * len(turn1.token_ids) + [0] * len(tool) + [1] * len(turn2.token_ids))
            sampled = turn1.log_probs + [0.0] * len(tool) + turn2.log_probs
            assert batch.rollout_logprobs[i, :length].tolist() == pytest.approx(sampled, abs=1e-6)
            answer = TOK.decode(turn1.token_ids, skip_special_tokens=True)
            assert batch.scores[i].item() == pytest.approx(min(len(answer), 10) / 10)  # calc_reward, not length
    rows = [json.loads(x) for x in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns/max" in r]
    assert len(steps) == 3 and all(r["agent/turns/max"] == 2 and r["agent/env_errors"] == 0 for r in steps)


@pytest.mark.skipif(not REAL_VERL, reason="verl (with its dependencies) is not installed")
def test_verls_own_tool_agent_loop_runs_on_scalerls_engine(tmp_path, monkeypatch):
    """verl's ToolAgentLoop itself (0.9.1: the tools handed in, the Continuous Token builder), with a tool
    subclassing verl's own BaseTool, from verl's tool config."""
    forget_modules("verl")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_verl_tools.py").write_text(USER_TOOLS)
    (tmp_path / "tool_config.yaml").write_text(TOOL_CONFIG)
    cfg = _cfg(tmp_path, "rollout.agent.verl_loop=verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop",
               "rollout.agent.max_tool_calls_per_turn=1")
    try:
        make_env = verl_loop_factory(cfg, TOK, LIMITS)
        trajectories, records = _run(make_env, [_verl_row("6+1=", "tool_agent", "7")],
                                     _call("submit_answer", answer="7"))
        t, r = trajectories[0], records[0]
        assert r.end == "done" and "error" not in r.info, r.info
        call, result, answer = t.segments
        assert call.generated and answer.generated and not result.generated
        assert result.token_ids == TOK.encode("got 1") and TOK.decode(answer.token_ids) == "ok"
        assert r.info["verl_extra_fields"]["tool_rewards"] == [0.0]  # verl's step reward; no reward_score
        assert r.reward is None
    finally:
        sys.modules.pop("user_verl_tools", None)


def test_the_verl_agent_loop_example_runs_as_its_docs_say(verl_files):
    from pathlib import Path

    examples = Path(__file__).resolve().parents[3] / "examples" / "agents"
    loop = f"{examples}/verl_agent_loop.py:AnswerAgentLoop"
    cfg = load_config(None, ["rollout.agent.env=verl", f"rollout.agent.verl_loop={loop}",
                             f"rollout.agent.tool_config={examples}/verl_tool_config.yml"])
    try:
        make_env = verl_loop_factory(cfg, TOK, LIMITS)
        rows = [_verl_row("12+7=", "answer_agent", "19"), _verl_row("12+8=", "answer_agent", "20")]
        for row in rows:  # the example's tool is named submit_answer too, its ground truth from create_kwargs
            assert row["extra_info"]["tools_kwargs"]["submit_answer"]["create_kwargs"]["ground_truth"]
        trajectories, records = _run(make_env, rows, _call("submit_answer", answer="19"))
    finally:
        sys.modules.pop("verl_answer_tool", None)
    assert [r.reward for r in records] == [1.0, 0.0] and all(r.end == "done" for r in records)
    for t in trajectories:
        call, result, answer = t.segments
        assert call.generated and answer.generated and result.token_ids == TOK.encode("received 19")


def test_a_sampled_turn_the_loop_masks_stays_with_its_logprobs_out_of_the_loss(verl_files):
    """response_mask 0 on tokens the engine sampled (a draft kept in the conversation): the turn is the engine's
    segment, ids and log-probs as sampled, with a loss mask of 0; laid out, the batch trains none of it."""
    from scalerl.rollout.trajectory import trajectories_to_output

    make_env = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:MaskedDraftLoop"), TOK,
                                 LIMITS)
    trajectories, records = _run(make_env, [_verl_row("6+1=", None)], "12")
    assert records[0].end == "done" and "error" not in records[0].info, records[0].info
    (draft, final), output = sys.modules["user_verl_loops"].TRACE[-1]
    first, nudge, second = trajectories[0].segments
    assert first.generated and first.token_ids == draft.token_ids and first.logprobs == draft.log_probs
    assert first.loss_mask == [0] * len(draft.token_ids) and second.loss_mask is None  # all trained: no mask
    assert not nudge.generated and second.token_ids == final.token_ids
    out = trajectories_to_output(trajectories, TOK.pad_token_id)
    n = len(output.response_ids)
    assert out.loss_mask[0, :n].tolist() == output.response_mask  # the loop's mask, as it gave it
    assert out.logprobs[0, : len(draft.token_ids)].tolist() == pytest.approx(draft.log_probs)  # kept in place
    calls = [([1, 2], TrajectorySegment([5, 6], True, [-0.1, -0.2]))]
    episode = episode_from_output("L", {"prompt_ids": [1, 2], "response_ids": [5, 6], "response_mask": [1, 0]}, calls)
    assert episode.segments[0] is calls[0][1] and calls[0][1].loss_mask == [1, 0]  # part of a turn, per token


def test_a_loops_own_stop_tokens_reach_the_engine_and_stop_strings_are_refused(verl_files):
    make_env = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:StopAtBang"), TOK, LIMITS)
    trajectories, records = _run(make_env, [_verl_row("6+1=", None)], "ab!cd")
    assert records[0].end == "done" and "error" not in records[0].info, records[0].info
    (turn,) = trajectories[0].segments
    assert TOK.decode(turn.token_ids) == "ab!" and trajectories[0].finish_reason == "stop"  # the stop token kept
    plain = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:MaskedDraftLoop"), TOK,
                              LIMITS)
    trajectories, _ = _run(plain, [_verl_row("6+1=", None)], "ab!cd")
    assert TOK.decode(trajectories[0].segments[0].token_ids, skip_special_tokens=True) == "ab!cd"  # no stop of its own
    refused = verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:StopStrings"), TOK, LIMITS)
    _, records = _run(refused, [_verl_row("6+1=", None)], "12")
    assert ("verl agent loop StopStrings (agent_name 'stop_strings') asked generate to stop at the strings "
            "['</answer>']; scalerl's engine stops at token ids only") in records[0].info["error"]


def test_function_tools_reach_a_verl_loop_as_verls_function_tools(verl_files):
    """rollout.agent.function_tool_path with env=verl: the file loads through verl's loader (the stand-in's here)
    and the loop gets its FunctionTool objects among its tools, as verl 0.9.1's worker hands them over."""
    from tests.rollout.agent.test_adapters import FUNCTION_TOOLS_FILE

    (verl_files / "fns.py").write_text(FUNCTION_TOOLS_FILE)
    cfg = _cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:FunctionToolLoop",
               f"rollout.agent.function_tool_path={verl_files}/fns.py")
    make_env = verl_loop_factory(cfg, TOK, LIMITS)
    trajectories, records = _run(make_env, [_verl_row("2+3=", None)], "12")
    assert records[0].end == "done" and "error" not in records[0].info, records[0].info
    first, result, second = trajectories[0].segments
    assert first.generated and second.generated and TOK.decode(result.token_ids) == '{"sum": 5}'
    clash = verl_files / "clash.py"
    clash.write_text('from verl.tools.function_tool import function_tool\n\n@function_tool\n'
                     'def submit_answer(answer: str) -> str:\n    """Submit.\n\n    Args:\n        answer: it\n    """\n'
                     '    return answer\n')
    with pytest.raises(ToolDefinitionError, match="tool name 'submit_answer' is declared by rollout.agent.tool_config="):
        verl_loop_factory(_cfg(verl_files, "rollout.agent.verl_loop=user_verl_loops:FunctionToolLoop",
                               f"rollout.agent.function_tool_path={clash}"), TOK, LIMITS)


def test_a_loop_masking_sampled_turns_trains_from_the_config_line(tiny_config, length_reward, tmp_path, verl_files):
    """A few steps of the draft-masking loop: each row holds both sampled turns with the engine's log-probs, and the
    batch's loss mask (what the loss, KL, entropy and metrics read) is 0 on the draft and 1 on the final turn."""
    from scalerl.trainer.rl_trainer import RLTrainer

    data = tmp_path / "verl_rows.jsonl"
    data.write_text("".join(json.dumps({
        "data_source": "test", "prompt": [{"role": "user", "content": f"{a}+{a}="}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)}, "agent_name": "masked_draft",
        "extra_info": {"index": a}}) + "\n" for a in range(1, 21)))
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=3", "rollout.agent.env=verl", "rollout.agent.verl_loop=user_verl_loops:MaskedDraftLoop",
        "data.format=verl", f"data.train_files=[{data}]", f"data.val_files=[{data}]", length_reward,
        f"trainer.output_dir={tmp_path}/m"))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    trace = sys.modules["user_verl_loops"].TRACE
    assert len(batches) == 3
    for batch in batches:
        for i in range(len(batch)):
            length = int(batch.response_attention[i].sum())
            response = batch.response_ids[i, :length].tolist()
            (draft, final), output = next((o, out) for o, out in trace if out.response_ids == response)
            d, f = len(draft.token_ids), len(final.token_ids)
            assert response[:d] == draft.token_ids and response[length - f:] == final.token_ids
            assert batch.response_mask[i, :length].tolist() == [0] * (length - f) + [1] * f == output.response_mask
            sampled = draft.log_probs + [0.0] * (length - d - f) + final.log_probs
            assert batch.rollout_logprobs[i, :length].tolist() == pytest.approx(sampled, abs=1e-6)
    rows = [json.loads(x) for x in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns/max" in r]
    assert len(steps) == 3 and all(r["agent/env_errors"] == 0 and r["agent/turns/max"] == 2 for r in steps)


def test_a_verl_loop_with_function_tools_trains_from_the_config_line(tiny_config, length_reward, tmp_path,
                                                                     verl_files):
    """Two steps of the loop that calls the @function_tool file's add after its first turn: every row holds the
    function's answer between the two sampled turns, untrained."""
    from scalerl.trainer.rl_trainer import RLTrainer
    from tests.rollout.agent.test_adapters import FUNCTION_TOOLS_FILE

    (verl_files / "fns.py").write_text(FUNCTION_TOOLS_FILE)
    data = tmp_path / "verl_rows.jsonl"
    data.write_text("".join(json.dumps({
        "data_source": "test", "prompt": [{"role": "user", "content": f"{a}+{a}="}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)}, "agent_name": "function_tool_agent",
        "extra_info": {"index": a}}) + "\n" for a in range(1, 21)))
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=2", "rollout.agent.env=verl", "rollout.agent.verl_loop=user_verl_loops:FunctionToolLoop",
        f"rollout.agent.function_tool_path={verl_files}/fns.py", "data.format=verl", f"data.train_files=[{data}]",
        f"data.val_files=[{data}]", length_reward, f"trainer.output_dir={tmp_path}/f"))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    assert len(batches) == 2
    for batch in batches:
        for i in range(len(batch)):
            length = int(batch.response_attention[i].sum())
            mask = batch.response_mask[i, :length].tolist()
            ids = batch.response_ids[i, :length].tolist()
            start, stop = mask.index(0), length - mask[::-1].index(0)  # the function's answer: the untrained run
            assert mask == [1] * start + [0] * (stop - start) + [1] * (length - stop)
            assert TOK.decode(ids[start:stop]) == '{"sum": 5}'
