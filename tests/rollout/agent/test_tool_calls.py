"""Tool-call parsing, Hermes format (Qwen2.5, Qwen3): calls and the text around them, each kind of malformed
call with its message for the model, reasoning that is content, and parsing that never evaluates."""

from __future__ import annotations

import json

import pytest

from scalerl.core.errors import UserError
from scalerl.rollout.agent.tool_calls import (
    PARSERS,
    HermesToolCallParser,
    ToolCall,
    ToolCallParser,
    get_parser,
)

PARSER = get_parser("hermes")


def _call(name: str, arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_one_call():
    text = _call("get_weather", {"city": "Paris"})
    turn = PARSER.parse(text)
    assert turn.calls == [ToolCall("get_weather", {"city": "Paris"}, text)]
    assert (turn.content, turn.errors) == ("", [])


def test_several_calls_and_the_text_around_them():
    first, second = _call("a", {"x": 1}), _call("b", {})
    turn = PARSER.parse(f"I will look both up.\n{first}\n{second}\nThen answer.")
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {"x": 1}), ("b", {})]
    assert [c.raw for c in turn.calls] == [first, second]
    assert turn.content == "I will look both up.\n\n\nThen answer."
    assert turn.errors == []


def test_plain_text_has_no_calls():
    turn = PARSER.parse("  The answer is 42.  ")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is 42.", [], [])


def test_malformed_json_is_an_error_and_the_good_calls_still_count():
    turn = PARSER.parse('<tool_call>{"name": "a", "arguments": {"x": 1,}}</tool_call>' + _call("b", {}))
    assert [c.name for c in turn.calls] == ["b"]
    assert len(turn.errors) == 1 and turn.errors[0].startswith("tool call 1 is not valid JSON (")


def test_partial_call_at_the_end_is_an_error():
    turn = PARSER.parse(f'Checking.{_call("a", {})}<tool_call>\n{{"name": "b", "argum')
    assert [c.name for c in turn.calls] == ["a"]
    assert turn.errors == ["tool call 2 is incomplete: <tool_call> without </tool_call>"]
    assert turn.content == "Checking."  # the cut call's text is not content


def test_complete_json_without_the_closing_tag_is_still_partial():
    turn = PARSER.parse('<tool_call>\n{"name": "a", "arguments": {}}\n')
    assert turn.calls == [] and turn.errors == ["tool call 1 is incomplete: <tool_call> without </tool_call>"]


def test_arguments_given_as_a_json_string_are_decoded_once():
    turn = PARSER.parse(_call("a", json.dumps({"x": 1})) + _call("b", json.dumps(json.dumps({"x": 1}))))
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {"x": 1})]
    assert turn.errors == ['tool call 2 (b): "arguments" must be a JSON object, got string']


def test_missing_arguments_mean_none():
    assert PARSER.parse('<tool_call>{"name": "now"}</tool_call>').calls[0].arguments == {}


@pytest.mark.parametrize("body, message", [
    ('["a", {}]', 'tool call 1 must be a JSON object {"name": ..., "arguments": {...}}, got array'),
    ('{"arguments": {}}', 'tool call 1 has no "name" (a string naming the tool)'),
    ('{"name": 3, "arguments": {}}', 'tool call 1 has no "name" (a string naming the tool)'),
    ('{"name": "a", "arguments": [1, 2]}', 'tool call 1 (a): "arguments" must be a JSON object, got array'),
    ('{"name": "a", "arguments": null}', 'tool call 1 (a): "arguments" must be a JSON object, got null'),
    ('{"name": "a", "arguments": "x=1"}', 'tool call 1 (a): "arguments" is a string that is not a JSON object'),
    ('[' * 100_000, "tool call 1 is not valid JSON (nested too deeply)"),
])
def test_each_kind_of_malformed_call_has_its_message(body, message):
    turn = PARSER.parse(f"<tool_call>{body}</tool_call>")
    assert (turn.calls, turn.errors) == ([], [message])


def test_reasoning_is_content_and_its_drafted_calls_are_not_calls():
    thought = f'<think>Maybe {_call("draft", {})} first.</think>'
    turn = PARSER.parse(f'{thought}\nCalling.{_call("real", {})}')
    assert [c.name for c in turn.calls] == ["real"]
    assert turn.content == f"{thought}\nCalling."
    # A template that opens the reasoning in the prompt: the completion starts inside it.
    opened = PARSER.parse(f'{_call("draft", {})}</think>{_call("real", {})}')
    assert [c.name for c in opened.calls] == ["real"] and opened.content.endswith("</think>")
    # Reasoning cut at the length limit: everything after <think> is reasoning.
    cut = PARSER.parse(f'<think>{_call("draft", {})}')
    assert cut.calls == [] and cut.errors == [] and cut.content.startswith("<think>")


def test_code_in_arguments_stays_a_string():
    code = "__import__('os').system('touch /tmp/pwned')"
    turn = PARSER.parse(_call("python", {"code": code}) + f'<tool_call>{{"name": {code}}}</tool_call>')
    assert turn.calls[0].arguments == {"code": code} and isinstance(turn.calls[0].arguments["code"], str)
    assert turn.errors[0].startswith("tool call 2 is not valid JSON (")  # unquoted code is bad JSON, nothing more


def test_closing_tag_inside_an_argument_does_not_end_the_call():
    turn = PARSER.parse(_call("write", {"text": "a </tool_call> b"}))
    assert turn.calls[0].arguments == {"text": "a </tool_call> b"} and turn.errors == []


def test_get_parser():
    parser = get_parser("hermes")
    assert isinstance(parser, HermesToolCallParser) and isinstance(parser, ToolCallParser)
    assert parser.stop_strings == ("</tool_call>",) and PARSERS["hermes"] is HermesToolCallParser
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: hermes") as error:
        get_parser("mistral")
    assert isinstance(error.value, UserError)  # the CLI reports it as bad input, without a traceback
