"""Tools: the schema a function gets (each kind of type hint, each docstring style, and the same schema as
transformers' `get_json_schema` where both apply), argument checks and their messages, `call_tool` (sync and
async functions, timeouts that leave the event loop free, exceptions, truncation), and loading tools named
in a config."""

from __future__ import annotations

import asyncio
import enum
import re
import threading
import time
from typing import Any, Literal, Optional

import pytest

from scalerl.rollout.agent.tools import (
    Tool,
    ToolDefinitionError,
    call_tool,
    tool_from_function,
    tools_from_module,
    validate_arguments,
)


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int | None = None):
    """Get the weather forecast for a city.

    Args:
        city: The city, e.g. Paris.
        unit (str): The temperature unit.
        days: How many days ahead
            to forecast.
    """
    return {"city": city, "unit": unit, "days": days}


def search(query: str, limit: int = 5, tags: list[str] | None = None, weights: dict[str, float] | None = None):
    """Search the documents.

    Args:
        query: What to look for.
        limit: At most this many results.
        tags: Only documents with these tags.
        weights: A weight per field.

    Returns:
        The matching documents.
    """
    return []


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@pytest.mark.parametrize("fn", [get_weather, search, add])
def test_schema_equals_transformers_get_json_schema(fn):
    transformers_utils = pytest.importorskip("transformers.utils")
    expected = transformers_utils.get_json_schema(fn)
    # transformers also describes the return value; chat templates ignore it, and a Tool has no field for it.
    expected["function"].pop("return", None)
    assert tool_from_function(fn).schema() == expected


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Point:
    """A class: the model cannot write one in JSON."""


def test_each_kind_of_type_hint():
    def f(i: int, x: float, s: str, b: bool, ints: list[int], table: dict[str, float], mode: Literal["a", "b"],
          mixed: Literal[1, "one"], maybe: Optional[int], maybe_too: str | None, either: int | str,  # noqa: UP045
          complex_union: list[int] | str, pair: tuple[int, str], color: Color, anything: Any, plain_list: list,
          plain_dict: dict, flag: bool = False):
        """F."""

    props = tool_from_function(f).parameters["properties"]
    assert props == {
        "i": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"}, "b": {"type": "boolean"},
        "ints": {"type": "array", "items": {"type": "integer"}},
        "table": {"type": "object", "additionalProperties": {"type": "number"}},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "mixed": {"type": ["integer", "string"], "enum": [1, "one"]},
        "maybe": {"type": "integer", "nullable": True}, "maybe_too": {"type": "string", "nullable": True},
        "either": {"type": ["integer", "string"]},
        "complex_union": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}]},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        "color": {"type": "string", "enum": ["red", "green"]}, "anything": {},
        "plain_list": {"type": "array"}, "plain_dict": {"type": "object"}, "flag": {"type": "boolean"},
    }
    assert tool_from_function(f).parameters["required"][-1] == "plain_dict"  # flag has a default


def test_defaults_are_optional_and_no_required_list_when_all_have_defaults():
    def f(a: int = 1, b: str = "x"):
        """F."""

    assert tool_from_function(f).parameters == {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                 "b": {"type": "string"}}}


def test_description_is_the_first_paragraph_joined():
    def f(a: int):
        """Do the first
        thing well.

        More detail the model does not need.

        Args:
            a: A number.
        """

    tool = tool_from_function(f, name="custom", timeout_s=3.0)
    assert (tool.name, tool.description, tool.timeout_s) == ("custom", "Do the first thing well.", 3.0)


def test_numpy_docstring():
    def f(a: int, b: str = "x"):
        """Numpy style.

        Parameters
        ----------
        a : int
            The first
            argument.
        b : str, optional
            The second.

        Returns
        -------
        int
            Not an argument.
        """

    props = tool_from_function(f).parameters["properties"]
    assert props["a"]["description"] == "The first argument."
    assert props["b"]["description"] == "The second."
    assert tool_from_function(f).description == "Numpy style."


def test_sphinx_docstring():
    def f(a: int, b: str = "x"):
        """Sphinx style.

        :param a: The first
            argument.
        :param str b: The second.
        :returns: Not an argument.
        """

    tool = tool_from_function(f)
    assert tool.description == "Sphinx style."
    assert tool.parameters["properties"]["a"]["description"] == "The first argument."
    assert tool.parameters["properties"]["b"]["description"] == "The second."


def test_choices_suffix_becomes_an_enum_and_missing_docs_are_allowed():
    def f(drink: str, size: int, note: str = ""):
        """Order.

        Args:
            drink: What to drink (choices: ["tea", "coffee"])
            size: Cups.
        """

    props = tool_from_function(f).parameters["properties"]
    assert props["drink"] == {"type": "string", "enum": ["tea", "coffee"], "description": "What to drink"}
    assert props["note"] == {"type": "string"}  # undocumented: no description, not an error


def test_functions_that_cannot_be_tools_are_refused_by_name():
    class Local:
        pass

    def no_hint(a):
        """F."""

    def custom(p: Point):
        """F."""

    def star(*values: int):
        """F."""

    def unresolvable(a: int, p: Local):  # a string annotation here (future import) naming a function's local
        """F."""

    with pytest.raises(ToolDefinitionError, match="'a' has no"):
        tool_from_function(no_hint)
    with pytest.raises(ToolDefinitionError, match="'p' has type hint"):
        tool_from_function(custom)
    with pytest.raises(ToolDefinitionError, match="by keyword"):
        tool_from_function(star)
    with pytest.raises(ToolDefinitionError, match="'p' has type hint 'Local', which does not resolve"):
        tool_from_function(unresolvable)


# ---- validation ------------------------------------------------------------------------------------------------

def _checker(a: int, x: float, unit: Literal["c", "f"] = "c", tags: list[str] | None = None,
             maybe: int | None = None):
    """Check."""


CHECKER = tool_from_function(_checker)


@pytest.mark.parametrize("arguments, message", [
    ([1, 2], "arguments must be a JSON object, got array"),
    ('{"a": 1}', "arguments must be a JSON object, got string"),
    ({"x": 1.0}, "missing required argument 'a'"),
    ({"a": 1, "x": 1.0, "z": 0}, "unknown argument 'z'; _checker takes: a, x, unit, tags, maybe"),
    ({"a": "1", "x": 1.0}, "argument 'a' must be integer, got string"),
    ({"a": True, "x": 1.0}, "argument 'a' must be integer, got boolean"),
    ({"a": 1.5, "x": 1.0}, "argument 'a' must be integer, got number"),
    ({"a": 1, "x": False}, "argument 'x' must be number, got boolean"),
    ({"a": None, "x": 1.0}, "argument 'a' must be integer, got null"),
    ({"a": 1, "x": 1.0, "unit": "k"}, 'argument \'unit\' must be one of ["c", "f"], got "k"'),
    ({"a": 1, "x": 1.0, "tags": ["ok", 3]}, "argument 'tags[1]' must be string, got integer"),
])
def test_each_kind_of_invalid_arguments_has_its_message(arguments, message):
    assert validate_arguments(CHECKER, arguments) == message


def test_valid_arguments():
    assert validate_arguments(CHECKER, {"a": 1, "x": 2}) is None  # an integer is a number
    assert validate_arguments(CHECKER, {"a": 1, "x": 2.5, "unit": "f", "tags": ["t"], "maybe": None}) is None


def test_arguments_are_data_never_evaluated():
    code = "__import__('os').system('echo pwned')"
    received = []

    def echo(text: str) -> str:
        """Echo."""
        received.append(text)
        return text

    assert validate_arguments(CHECKER, {"a": code, "x": 1.0}) == "argument 'a' must be integer, got string"
    assert asyncio.run(call_tool(tool_from_function(echo), {"text": code})).content == code
    assert received == [code]


# ---- call_tool ----------------------------------------------------------------------------------------------------

def test_sync_and_async_functions():
    async def fetch(url: str) -> str:
        """Fetch a page."""
        await asyncio.sleep(0)
        return f"<html>{url}</html>"

    weather = asyncio.run(call_tool(tool_from_function(get_weather), {"city": "Paris"}))
    page = asyncio.run(call_tool(tool_from_function(fetch), {"url": "a.b"}))
    assert (weather.content, weather.error) == ('{"city": "Paris", "unit": "celsius", "days": null}', False)
    assert (page.content, page.error, page.timed_out) == ("<html>a.b</html>", False, False)
    assert page.seconds >= 0


def test_non_json_results_are_shown_with_str():
    class Thing:
        def __str__(self):
            return "a thing"

    def make() -> Any:
        """Make."""
        return {(1, 2): "tuple key"}

    def things() -> Any:
        """Things."""
        return [Thing()]

    assert asyncio.run(call_tool(tool_from_function(things), {})).content == '["a thing"]'
    made = asyncio.run(call_tool(tool_from_function(make), {}))  # a key JSON cannot hold: str() instead
    assert (made.content, made.error) == ("{(1, 2): 'tuple key'}", False)


def test_slow_sync_function_times_out_without_blocking_a_concurrent_call():
    release = threading.Event()
    finished = []

    def slow() -> str:
        """Blocks its thread for up to 2 s."""
        release.wait(2.0)
        return "late"

    async def fast() -> str:
        """Quick."""
        await asyncio.sleep(0.05)
        return "quick"

    async def timed(tool: Tool):
        result = await call_tool(tool, {})
        finished.append(tool.name)
        return result

    async def both():
        start = time.perf_counter()
        try:
            results = await asyncio.gather(timed(tool_from_function(slow, timeout_s=0.3)),
                                           timed(tool_from_function(fast)))
            return (*results, time.perf_counter() - start)
        finally:
            # The abandoned thread would run on for 2 s, and asyncio.run waits for its pool's threads on exit.
            release.set()

    slow_result, fast_result, elapsed = asyncio.run(both())
    assert finished == ["fast", "slow"]
    assert fast_result.content == "quick" and fast_result.seconds < 0.3
    assert slow_result.timed_out and slow_result.error
    assert slow_result.content == "slow timed out after 0.3 s"
    assert 0.3 <= slow_result.seconds < 1.0 and elapsed < 1.0


def test_async_function_times_out():
    async def hang() -> str:
        """Never answers."""
        await asyncio.sleep(30)
        return ""

    result = asyncio.run(call_tool(tool_from_function(hang, timeout_s=0.1), {}))
    assert result.timed_out and result.seconds < 1.0


def test_exceptions_become_short_error_results():
    def lookup(city: str) -> str:
        """Look up."""
        raise ValueError(f"no such city: {city}")

    def own_timeout() -> str:
        """A tool whose own socket timed out: its exception, not our deadline."""
        raise TimeoutError("connect timed out")

    result = asyncio.run(call_tool(tool_from_function(lookup), {"city": "Atlantis"}))
    assert (result.content, result.error, result.timed_out) == (
        "lookup raised ValueError: no such city: Atlantis", True, False)
    own = asyncio.run(call_tool(tool_from_function(own_timeout), {}))
    assert (own.content, own.timed_out) == ("own_timeout raised TimeoutError: connect timed out", False)


def test_long_results_are_cut_in_the_middle():
    text = "HEAD" + "x" * 10_000 + "TAIL"

    def dump() -> str:
        """Dump."""
        return text

    content = asyncio.run(call_tool(tool_from_function(dump), {}, max_chars=200)).content
    marker = re.search(r"\n\[\.\.\. (\d+) characters cut \.\.\.\]\n", content)
    assert len(content) <= 200 and marker
    head, tail = content[: marker.start()], content[marker.end():]
    assert text.startswith(head) and text.endswith(tail) and head.startswith("HEAD") and tail.endswith("TAIL")
    assert len(head) + len(tail) + int(marker.group(1)) == len(text)
    assert asyncio.run(call_tool(tool_from_function(dump), {}, max_chars=len(text))).content == text


def test_invalid_arguments_never_call_the_function():
    calls = []

    def record(n: int) -> int:
        """Record."""
        calls.append(n)
        return n

    tool = tool_from_function(record)
    for bad in ({"n": "1"}, {}, {"n": 1, "m": 2}, ["n"]):
        result = asyncio.run(call_tool(tool, bad))
        assert result.error and result.content.startswith("invalid arguments for record: ")
    assert calls == []
    assert asyncio.run(call_tool(tool, {"n": 3})).content == "3" and calls == [3]


# ---- tools named in a config ------------------------------------------------------------------------------------

TOOLS_FILE = '''
from os.path import join  # imported, not defined here: not a tool


def first(a: int) -> int:
    """First."""
    return a


def _private(a: int) -> int:
    """Hidden."""
    return a


async def second(b: str) -> str:
    """Second."""
    return b
'''


def test_tools_from_a_file_and_a_module(tmp_path, monkeypatch):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    assert [t.name for t in tools_from_module(str(path))] == ["first", "second"]
    assert [t.name for t in tools_from_module(f"{path}:second")] == ["second"]
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = tools_from_module("my_tools:second, first")
    assert [t.name for t in tools] == ["second", "first"]
    assert asyncio.run(call_tool(tools[0], {"b": "hi"})).content == "hi"


def test_tool_specs_that_name_nothing(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    with pytest.raises(ToolDefinitionError, match="has no 'third'"):
        tools_from_module(f"{path}:third")
    with pytest.raises(ToolDefinitionError, match="does not exist"):
        tools_from_module(str(tmp_path / "absent.py"))
    with pytest.raises(ToolDefinitionError, match="cannot be imported"):
        tools_from_module("no_such_module_anywhere:f")
