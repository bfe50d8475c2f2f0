"""Reading tool calls out of a model's turn. Each chat family writes its calls in its own format; a
`ToolCallParser` turns the generated text into a `ParsedTurn`: the text outside the calls, the calls, and one
message per malformed call, which the agent loop shows the model so it can write the call again.

`HermesToolCallParser` reads the format of Hermes, Qwen2.5 and Qwen3 (their chat templates teach it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several per turn. Calls are JSON, decoded with `json` and never evaluated: an argument holding Python code is
a string like any other. `get_parser` picks a parser by the name a config gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from scalerl.core.config.tree import ConfigError
from scalerl.rollout.agent.tools import json_type

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    raw: str  # the call's text as generated, tags included


@dataclass
class ParsedTurn:
    content: str  # the text outside the calls (reasoning included), stripped at both ends
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per malformed call, worded for the model


@runtime_checkable
class ToolCallParser(Protocol):
    name: str
    # Where generation may stop once a call is complete. The engine must keep the stop text in what it returns
    # (scalerl's engines keep the stop token; vLLM needs include_stop_str_in_output=True), else the last call
    # reads as unclosed.
    stop_strings: tuple[str, ...]

    def parse(self, text: str) -> ParsedTurn: ...


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _split_thoughts(text: str) -> list[tuple[str, bool]]:
    """``text`` as (piece, is_reasoning) in order. Calls are read outside reasoning only: a model that drafts a
    call while thinking has not made it. A ``</think>`` with no ``<think>`` before it closes a block the
    prompt opened (templates that end the generation prompt with ``<think>``); an unclosed ``<think>`` runs
    to the end."""
    pieces, pos = [], 0
    first_close, first_open = text.find(THINK_CLOSE), text.find(THINK_OPEN)
    if first_close >= 0 and (first_open < 0 or first_open > first_close):
        pos = first_close + len(THINK_CLOSE)
        pieces.append((text[:pos], True))
    while (start := text.find(THINK_OPEN, pos)) >= 0:
        pieces.append((text[pos:start], False))
        end = text.find(THINK_CLOSE, start)
        pos = len(text) if end < 0 else end + len(THINK_CLOSE)
        pieces.append((text[start:pos], True))
    pieces.append((text[pos:], False))
    return [(piece, thought) for piece, thought in pieces if piece]


class HermesToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    stop_strings = ("</tool_call>",)

    def parse(self, text: str) -> ParsedTurn:
        content: list[str] = []
        turn = ParsedTurn("")
        for piece, is_thought in _split_thoughts(text):
            if is_thought:
                content.append(piece)
            else:
                self._parse_calls(piece, content, turn)
        turn.content = "".join(content).strip()
        return turn

    def _parse_calls(self, text: str, content: list[str], turn: ParsedTurn) -> None:
        pos = 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            content.append(text[pos:start])
            number = len(turn.calls) + len(turn.errors) + 1
            body_start = start + len(self.open_tag)
            end, decoded = self._decode(text, body_start)
            if end < 0:
                turn.errors.append(f"tool call {number} is incomplete: {self.open_tag} without {self.close_tag}")
                return
            raw, pos = text[start:end], end
            if isinstance(decoded, str):  # the decoder's complaint
                turn.errors.append(f"tool call {number} is not valid JSON ({decoded})")
            else:
                call = self._call(decoded, raw, number)
                if isinstance(call, ToolCall):
                    turn.calls.append(call)
                else:
                    turn.errors.append(call)
        content.append(text[pos:])

    def _decode(self, text: str, body_start: int) -> tuple[int, object]:
        """(end of the block, the JSON value or a message why it is not one); end is -1 for an unclosed block.
        The value is read by the JSON decoder first, so a ``</tool_call>`` inside an argument's string does
        not end the block early; the next closing tag is the fallback for text that is not JSON."""
        try:
            value, after = json.JSONDecoder().raw_decode(text, _skip_space(text, body_start))
            close = _skip_space(text, after)
            if text.startswith(self.close_tag, close):
                return close + len(self.close_tag), value
        except (json.JSONDecodeError, RecursionError):
            pass
        close = text.find(self.close_tag, body_start)
        if close < 0:
            return -1, None
        try:
            value = json.loads(text[body_start:close])
        except json.JSONDecodeError as exc:
            value = f"{exc.msg} at character {exc.pos}"
        except RecursionError:
            value = "nested too deeply"
        return close + len(self.close_tag), value

    @staticmethod
    def _call(value: object, raw: str, number: int) -> ToolCall | str:
        if not isinstance(value, dict):
            return (f'tool call {number} must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                    f"got {json_type(value)}")
        name = value.get("name")
        if not isinstance(name, str) or not name:
            return f'tool call {number} has no "name" (a string naming the tool)'
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string: decoded once
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                return f'tool call {number} ({name}): "arguments" is a string that is not a JSON object'
        if not isinstance(arguments, dict):
            return f'tool call {number} ({name}): "arguments" must be a JSON object, got {json_type(arguments)}'
        return ToolCall(name, arguments, raw)


PARSERS: dict[str, type] = {HermesToolCallParser.name: HermesToolCallParser}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered under ``name``."""
    if name not in PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
