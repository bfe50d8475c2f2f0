"""The tool task's tool, the scripted teacher's demonstrations and an episode on it: the tool computes the
operator and rejects bad arguments; the demonstrations parse with the Hermes parser under the built-in
tokenizer's template (plain concatenation), their SFT rows hold exactly the tokens the agent loop lays out,
and an episode through the agent loop calls the tool and gets its result as an untrained segment; through a
Qwen2.5-style chat template the rendered rows are the loop's episode token for token, its mask 1 on the turns."""

import asyncio

import torch

from scalerl.data.prompts import encode_demonstration
from scalerl.data.tool_arithmetic import (
    TOOL_SPEC,
    chat_tool_demonstration_rows,
    demonstration_sft_rows,
    make_tool_arithmetic_rows,
    op,
    tool_answer_reward,
    tool_demonstration,
    tool_demonstration_rows,
)
from scalerl.demo import tool_environment_factory
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.chat_delta import ChatContinuity
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop
from scalerl.rollout.agent.tool_calls import get_parser
from scalerl.rollout.agent.tools import call_tool, tool_from_function, tools_from_module
from scalerl.rollout.engines.continuous import RequestOutput
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import trajectories_to_output
from tests.rollout.agent.chat_templates import QWEN25, chat_tokenizer

TOK = CharTokenizer()
ROWS = make_tool_arithmetic_rows("test", 6, [1, 2, 3], seed=0)


def test_the_tool_computes_the_operator_and_rejects_bad_arguments():
    (tool,) = tools_from_module(TOOL_SPEC)
    assert tool.name == "op" and tool.parameters["required"] == ["a", "b"]
    assert tool.parameters["properties"]["a"]["type"] == "integer" and "@" in tool.description

    def run(arguments):
        return asyncio.run(call_tool(tool, arguments))

    assert run({"a": 47, "b": 38}).content == str(47 * 38 + 47 + 38) and not run({"a": 47, "b": 38}).error
    for bad, message in (({"a": "47", "b": 38}, "must be integer"), ({"a": 1}, "missing required argument 'b'"),
                         ({"a": True, "b": 2}, "must be integer"), ({"a": 1.5, "b": 2}, "must be integer"),
                         ({"a": 1, "b": 2, "c": 3}, "unknown argument 'c'"), ({"a": 10**7, "b": 1}, "out of range")):
        result = run(bad)
        assert result.error and message in result.content, (bad, result.content)
    assert tool_from_function(op).schema() == tool.schema()


def test_demonstrations_parse_with_the_hermes_parser_and_hold_the_right_answer():
    parser, env = get_parser("hermes"), tool_environment_factory()()
    for row in ROWS:
        _user, call, result, answer = tool_demonstration(row)
        parsed = parser.parse(call["content"])
        assert not parsed.errors and [(c.name, c.arguments) for c in parsed.calls] == [
            ("op", {"a": row["operands"][0], "b": row["operands"][1]})]
        env.reset(row)
        step = asyncio.run(env.step(call))  # the tool environment answers the call with the demonstration's result
        assert [m["content"] for m in step.messages] == [result["content"]] == [row["ground_truth"]]
        assert not parser.parse(answer["content"]).calls and asyncio.run(env.step(answer)).done
        assert tool_answer_reward(call["content"] + result["content"] + answer["content"], row["ground_truth"]) == 1.0


def test_sft_rows_hold_the_tokens_the_agent_loop_lays_out_under_the_builtin_template():
    """Through the built-in tokenizer's template (contents concatenated) the agent loop's context at the second
    turn is prompt + the call + the eos the engine sampled + the tool's result: the answer row's prompt."""
    row = ROWS[0]
    messages = tool_demonstration(row)
    call_row, answer_row = demonstration_sft_rows(messages, TOK.token_string(TOK.eos_token_id))
    assert [r["response"] for r in tool_demonstration_rows([row])] == [call_row["response"], answer_row["response"]]
    continuity = ChatContinuity(TOK, [t.schema() for t in tools_from_module(TOOL_SPEC)])
    first = continuity.prompt(messages[:1])
    assert first == TOK.encode(call_row["prompt"])  # no BOS: SFT with data.chat_template=true encodes it so too
    turn = TOK.encode(messages[1]["content"]) + [TOK.eos_token_id]
    delta = continuity.continuation([messages[2]], turn[-1])
    assert delta.bridged and TOK.decode(delta.token_ids) == row["ground_truth"]
    assert TOK.encode(answer_row["prompt"]) == first + turn + delta.token_ids


class TeacherEngine:
    """A continuous engine that answers as the scripted teacher, in ``tokenizer``'s ids: the call, then (once a
    result follows) the final answer; log-probs zero."""

    def __init__(self, tokenizer=TOK):
        self.pending, self.turns = [], {row["prompt"]: tool_demonstration(row) for row in ROWS}
        self.tokenizer = tokenizer

    def submit(self, request):
        self.pending.append(request)

    def abort(self, ids):
        return 0

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        outputs = []
        for request in self.pending:
            text = self.tokenizer.decode(request.prompt_ids)
            prompt = next(p for p in self.turns if p in text)
            messages = self.turns[prompt]
            reply = messages[3 if "</tool_call>" in text else 1]["content"]
            ids = torch.tensor(self.tokenizer.encode(reply) + [self.tokenizer.eos_token_id])
            outputs.append(RequestOutput(request.request_id, list(request.prompt_ids), ids,
                                         torch.zeros(len(ids)), torch.zeros(len(ids), dtype=torch.long), "stop"))
        self.pending = []
        return outputs


def test_an_episode_on_the_tool_task_calls_the_tool_and_its_result_is_an_untrained_segment():
    loop = AgentLoop(TeacherEngine(), TOK, tool_environment_factory(), AgentLimits(max_turns=2, max_total_tokens=256))
    trajectories, records = loop.run(ROWS, SamplingParams(max_new_tokens=80, temperature=0.0,
                                                          stop_token_ids=TOK.stop_token_ids))
    for row, trajectory, record in zip(ROWS, trajectories, records):
        assert [s.generated for s in trajectory.segments] == [True, False, True]
        assert TOK.decode(trajectory.segments[1].token_ids) == row["ground_truth"]  # the tool's result
        assert record.end == "done" and record.info["tool_calls"] == 1 and record.info["tool_errors"] == 0
        assert tool_answer_reward(TOK.decode(trajectory.response_ids), row["ground_truth"]) == 1.0


# ---- a chat-template model (Qwen2.5's template, written by the tests: chat_templates.py) ---------------------

def test_chat_template_sft_rows_hold_the_tokens_the_agent_loop_lays_out_and_the_loss_covers_the_model_turns():
    """Through a Qwen2.5-style template with tools, the rows of `chat_tool_demonstration_rows`, encoded as the SFT
    trainer encodes them with ``data.chat_template=false``, are token for token the agent loop's episode on the
    scripted teacher: row k's prompt is the trajectory up to turn k (the system block with the tool's schema,
    the earlier turns with their <|im_end|>, the template's newline after it, the tool's result), its response
    turn k + <|im_end|>; the trajectory's loss mask is 1 on exactly those turns' tokens."""
    tok = chat_tokenizer(QWEN25)
    make_env = tool_environment_factory()
    demos = chat_tool_demonstration_rows(ROWS, tok, lambda row: make_env().reset(row))
    loop = AgentLoop(TeacherEngine(tok), tok, make_env, AgentLimits(max_turns=2, max_total_tokens=1024))
    trajectories, records = loop.run(ROWS, SamplingParams(max_new_tokens=80, temperature=0.0,
                                                          stop_token_ids=tok.stop_token_ids))
    layout = trajectories_to_output(trajectories, tok.pad_token_id)
    for i, (row, trajectory, record) in enumerate(zip(ROWS, trajectories, records)):
        assert record.end == "done" and record.info["tool_calls"] == 1 and record.prefix_breaks == 0
        assert [s.generated for s in trajectory.segments] == [True, False, True]
        call_row, answer_row = demos[2 * i: 2 * i + 2]
        assert call_row["prompt"].startswith("<|im_start|>system\nYou may call tools:") and '"name": "op"' in \
            call_row["prompt"] and call_row["prompt"].endswith("A:<|im_end|>\n<|im_start|>assistant\n")
        assert answer_row["prompt"].endswith(f"</tool_call><|im_end|>\n<|im_start|>user<tool_response>\n"
                                             f"{row['ground_truth']}\n</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")
        context = list(trajectory.prompt_ids)
        for demo, segment in zip((call_row, answer_row), trajectory.segments[::2]):
            assert encode_demonstration(tok, demo, chat_template=False) == (context, segment.token_ids)
            context += segment.token_ids + (trajectory.segments[1].token_ids if demo is call_row else [])
        # The mask the loss, the log-probs and the KL read: 1 on the two sampled turns (their <|im_end|>
        # included), 0 on the tool's result and the template's tokens around it, and on padding.
        call, result, answer = (s.token_ids for s in trajectory.segments)
        expected = [1] * len(call) + [0] * len(result) + [1] * len(answer)
        width = len(expected)
        assert layout.loss_mask[i, :width].tolist() == expected and not layout.loss_mask[i, width:].any()
        assert layout.response_ids[i, :width].tolist() == call + result + answer
        assert call[-1] == answer[-1] == tok.eos_token_id and tok.token_string(result[0]) == "\n"
