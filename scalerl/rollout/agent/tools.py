"""Tools an agent's model may call: a `Tool` (name, description, JSON schema of its arguments, the function),
built from a plain or async Python function by `tool_from_function` (the schema from its type hints and
docstring, in the shape `transformers.utils.get_json_schema` gives), arguments checked against the schema by
`validate_arguments`, and `call_tool`, which runs one call under a timeout and always returns a `ToolResult`
the model can read: a bad call, an exception or a hang becomes a short message, never a crashed rollout.

`tools_from_module` loads the functions a config names ("pkg.mod:fn1,fn2", "path/file.py:fn", or a whole
module), as TRL users pass ``tools=[fn, ...]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import importlib
import importlib.util
import inspect
import json
import re
import sys
import time
import types
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalerl.core.errors import UserError


class ToolDefinitionError(UserError, ValueError):
    """A function that cannot be offered to the model as a tool, or a tool spec that names nothing."""


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": [...]}
    function: Callable[..., Any]  # plain or async, called with keyword arguments
    timeout_s: float = 10.0

    def schema(self) -> dict:
        """The entry a chat template's ``tools=[...]`` takes (OpenAI / Hugging Face format)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolResult:
    content: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


# ---- the schema from a function ------------------------------------------------------------------------------

_JSON_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE_TYPES = {**{t: {"type": name} for t, name in _JSON_SCALARS.items()},
               list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}
_GOOGLE_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments):\s*$")
_GOOGLE_ARG = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^()]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^(\s*):(?:param|parameter|arg|argument|key|keyword)\s+(?:[^:]*\s)?\*{0,2}(\w+)\s*:\s*(.*)$")
_SECTION_START = re.compile(r"^\s*(?:(?:Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?"
                            r"|Keyword Args|Keyword Arguments|Attributes|See Also|Warnings?)\s*:\s*$|:\w+)")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _enum_schema(values: list) -> dict:
    # One JSON type per kind of value, in order of first appearance, as transformers writes it.
    names = list(dict.fromkeys(_JSON_SCALARS[type(v)] for v in values))
    return {"type": names[0] if len(names) == 1 else names, "enum": values}


def _hint_schema(hint: Any, where: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and origin is None:
        values = [member.value for member in hint]
        if values and all(type(v) in _JSON_SCALARS for v in values):
            return _enum_schema(values)
    elif origin is None and hint in _BARE_TYPES:
        return dict(_BARE_TYPES[hint])
    elif origin is typing.Union or origin is types.UnionType:
        subs = [_hint_schema(a, where) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    elif origin is typing.Literal and args and all(type(a) in _JSON_SCALARS for a in args):
        return _enum_schema(list(args))
    elif origin is list:
        return {"type": "array", "items": _hint_schema(args[0], where)} if args else {"type": "array"}
    elif origin is tuple and len(args) > 1 and ... not in args:
        return {"type": "array", "prefixItems": [_hint_schema(a, where) for a in args]}
    elif origin is dict:
        return {"type": "object", **({"additionalProperties": _hint_schema(args[1], where)} if len(args) == 2 else {})}
    raise ToolDefinitionError(f"{where} has type hint {hint!r}, which has no JSON schema; use int, float, str, bool, "
                              "list[...], dict[str, ...], Literal[...], an Enum or X | None, or build Tool(...) "
                              "with a hand-written schema")


def _paragraph_lines(lines: list[str], start: int, indent: int) -> list[str]:
    """The lines from ``start`` indented deeper than ``indent`` (blank ones skipped), up to the first that is not."""
    out = []
    for line in lines[start:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    return [line for line in out if line.strip()]


def _argument_docs(lines: list[str]) -> dict[str, str]:
    """Per-argument descriptions from a Google "Args:" section, a numpy "Parameters / ----------" section or
    Sphinx ":param x:" fields; continuation lines are joined with spaces."""
    docs: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        if google := _GOOGLE_HEADER.match(line):
            body = _paragraph_lines(lines, i + 1, len(google.group(1)))
            base = min((len(b) - len(b.lstrip()) for b in body), default=0)
            current = None
            for b in body:
                entry = _GOOGLE_ARG.match(b.strip()) if len(b) - len(b.lstrip()) == base else None
                if entry:
                    current = docs.setdefault(entry.group(1), [])
                    current.append(entry.group(2))
                elif current is not None:
                    current.append(b.strip())
        elif line.strip() in ("Parameters", "Other Parameters") and i + 1 < len(lines) \
                and re.fullmatch(r"\s*-{3,}\s*", lines[i + 1]):
            base = len(line) - len(line.lstrip())
            current = None
            for j in range(i + 2, len(lines)):
                b = lines[j]
                if not b.strip():
                    continue
                if j + 1 < len(lines) and re.fullmatch(r"\s*-{3,}\s*", lines[j + 1]):
                    break  # the next numpy section's header
                if len(b) - len(b.lstrip()) == base:
                    current = docs.setdefault(b.split(":")[0].strip().lstrip("*"), [])
                elif current is not None:
                    current.append(b.strip())
        elif sphinx := _SPHINX_PARAM.match(line):
            docs[sphinx.group(2)] = [sphinx.group(3)] + [
                b.strip() for b in _paragraph_lines(lines, i + 1, len(sphinx.group(1)))]
    return {name: " ".join(p for p in parts if p).strip() for name, parts in docs.items()}


def _described(schema: dict, text: str | None) -> dict:
    if text is None:
        return schema
    choices = _CHOICES.search(text)
    if choices:  # transformers' "(choices: [...])" suffix: a JSON list that becomes the enum
        try:
            values = json.loads(choices.group(1))
        except json.JSONDecodeError:
            values = None
        if isinstance(values, list):
            schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[: choices.start()].strip()
    schema["description"] = text
    return schema


def _resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - one hint that does not resolve fails them all: resolve each alone
        hints = {}
        for arg, annotation in getattr(fn, "__annotations__", {}).items():
            holder = types.SimpleNamespace(__annotations__={arg: annotation})
            with contextlib.suppress(Exception):  # one left as its string is reported by name by the caller
                hints.update(typing.get_type_hints(holder, globalns=getattr(fn, "__globals__", {})))
        return hints


def tool_from_function(fn: Callable[..., Any], name: str | None = None, timeout_s: float = 10.0) -> Tool:
    """A tool from a typed function: its description is the docstring's first paragraph, each argument's schema
    comes from its type hint and its description from the docstring; arguments with defaults are optional."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    name = name or getattr(target, "__name__", None)
    if not name:
        raise ToolDefinitionError(f"tool_from_function({fn!r}) needs a name=")
    hints = _resolved_hints(inspect.unwrap(target))
    properties, required = {}, []
    lines = (inspect.getdoc(target) or "").splitlines()
    arg_docs = _argument_docs(lines)
    for arg, param in inspect.signature(fn).parameters.items():
        if param.kind is param.VAR_KEYWORD:
            continue  # **kwargs cannot be described; the model is offered the named arguments only
        if param.kind in (param.VAR_POSITIONAL, param.POSITIONAL_ONLY):
            raise ToolDefinitionError(f"tool {name}: argument {arg!r} cannot be passed by keyword, as tools are called")
        hint = hints.get(arg, param.annotation)
        if hint is param.empty:
            raise ToolDefinitionError(f"tool {name}: argument {arg!r} has no type hint; the model needs its type")
        if isinstance(hint, str):
            raise ToolDefinitionError(f"tool {name}: argument {arg!r} has type hint {hint!r}, which does not "
                                      "resolve (a name defined inside a function, or not imported?)")
        properties[arg] = _described(_hint_schema(hint, f"tool {name}: argument {arg!r}"), arg_docs.get(arg))
        if param.default is param.empty:
            required.append(arg)
    first_paragraph = []
    for line in lines:
        if not line.strip() or _SECTION_START.match(line):
            if first_paragraph or _SECTION_START.match(line):
                break
            continue
        first_paragraph.append(line.strip())
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    return Tool(name, " ".join(first_paragraph), parameters, fn, timeout_s)


# ---- checking a call's arguments ---------------------------------------------------------------------------

def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, as messages to the model say it."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), ((list, tuple), "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


_TYPE_NAMES = {"null", "boolean", "integer", "number", "string", "array", "object"}


def _is_type(value: Any, name: str) -> bool:
    kind = json_type(value)
    # JSON has one number type: an integer is a number, but true/false are not integers (unlike Python's bool).
    # Types beyond JSON's own (transformers' "image", "audio") cannot be checked here: accepted.
    return kind == name or (name == "number" and kind == "integer") or name not in _TYPE_NAMES


def _shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check(value: Any, schema: dict, path: str) -> str | None:
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if all(_check(value, sub, path) for sub in schema["anyOf"]):
            return f"argument {path!r} matches none of its allowed forms (got {json_type(value)})"
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds and not any(_is_type(value, k) for k in kinds):
        return f"argument {path!r} must be {' or '.join(kinds)}, got {json_type(value)}"
    if "enum" in schema and not any(v == value and isinstance(v, bool) == isinstance(value, bool)
                                    for v in schema["enum"]):
        return f"argument {path!r} must be one of {_shown(schema['enum'], 200)}, got {_shown(value)}"
    if isinstance(value, (list, tuple)):
        items = schema.get("prefixItems") or [schema.get("items") or {}] * len(value)
        for i, (item, sub) in enumerate(zip(value, items)):
            if problem := _check(item, sub, f"{path}[{i}]"):
                return problem
    if isinstance(value, dict):
        properties, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key in schema.get("required", []):
            if key not in value:
                return f"argument {path!r} is missing key {key!r}"
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is None and extra is False:
                return f"argument {path!r} has unknown key {key!r}"
            if sub and (problem := _check(item, sub, f"{path}.{key}")):
                return problem
    return None


def validate_arguments(tool: Tool, arguments: Any) -> str | None:
    """None when ``arguments`` fit the tool's schema, else a short message for the model naming the first
    problem. The arguments are only inspected as data."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {json_type(arguments)}"
    properties = tool.parameters.get("properties", {})
    for key in tool.parameters.get("required", []):
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in properties:
            # Stricter than JSON schema's default at the top level only: an extra keyword argument would make
            # the Python call itself fail, with a less useful message.
            if not tool.parameters.get("additionalProperties"):
                return f"unknown argument {key!r}; {tool.name} takes: {', '.join(properties) or 'no arguments'}"
        elif problem := _check(value, properties[key], key):
            return problem
    return None


# ---- running a call -----------------------------------------------------------------------------------------

def _truncate_middle(text: str, max_chars: int) -> str:
    """The start and the end of ``text`` (both usually matter: a header, a final error line) with the middle
    cut, at most ``max_chars`` characters in all."""
    if len(text) <= max_chars:
        return text
    longest_marker = len(f"\n[... {len(text)} characters cut ...]\n")
    keep = max(0, max_chars - longest_marker)
    head, tail = text[: keep - keep // 2], text[len(text) - keep // 2:]
    return f"{head}\n[... {len(text) - keep} characters cut ...]\n{tail}"


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # non-str keys, cycles: still something to show
        return str(value)


def _is_async(fn: Callable[..., Any]) -> bool:
    # An object with an ``async def __call__`` is async too, though `iscoroutinefunction` says no for it.
    plain = inspect.isroutine(fn) or isinstance(fn, functools.partial)
    return inspect.iscoroutinefunction(fn if plain else type(fn).__call__)


async def _invoke(tool: Tool, arguments: dict) -> tuple[Any, Exception | None]:
    # The tool's own exceptions are caught here, inside the timeout, so a TimeoutError the tool raises (a
    # socket's, say) is reported as its exception and not mistaken for our deadline.
    try:
        if _is_async(tool.function):
            return await tool.function(**arguments), None
        result = await asyncio.to_thread(tool.function, **arguments)
        return (await result if inspect.isawaitable(result) else result), None
    except Exception as exc:  # noqa: BLE001 - any failure of the tool is the model's to read
        return None, exc


async def call_tool(tool: Tool, arguments: dict, max_chars: int = 4096) -> ToolResult:
    """Run one call: arguments checked first (an invalid call never reaches the function), a plain function in
    a worker thread so the event loop and the other calls go on, everything under ``tool.timeout_s``."""
    start = time.perf_counter()
    if problem := validate_arguments(tool, arguments):
        return ToolResult(f"invalid arguments for {tool.name}: {problem}", error=True,
                          seconds=time.perf_counter() - start)
    try:
        # asyncio cannot stop a thread: a plain function past its deadline is abandoned, not killed. It runs on
        # in its pool thread until it returns, its result discarded, and holds that thread meanwhile (the
        # default pool has min(32, cpus + 4)); a tool that may hang should bound itself or be async.
        value, exc = await asyncio.wait_for(_invoke(tool, arguments), tool.timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(f"{tool.name} timed out after {tool.timeout_s:g} s", error=True, timed_out=True,
                          seconds=time.perf_counter() - start)
    if exc is not None:
        content, error = f"{tool.name} raised {type(exc).__name__}: {exc}", True
    else:
        content, error = _as_text(value), False
    return ToolResult(_truncate_middle(content, max_chars), error=error, seconds=time.perf_counter() - start)


# ---- tools named in a config --------------------------------------------------------------------------------

def _load_module(where: str) -> types.ModuleType:
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ToolDefinitionError(f"tool file {where} does not exist")
        # A name of our own, so a user's "tools.py" cannot shadow or be shadowed by an importable "tools".
        name = f"scalerl_user_tools_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it, as dataclasses and pickling look it up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise ToolDefinitionError(f"tool module {where!r} cannot be imported: {exc}") from exc


def tools_from_module(spec: str) -> list[Tool]:
    """Tools from "pkg.module:fn1,fn2", "path/file.py:fn1,fn2", or "pkg.module" / "path/file.py" alone (every
    public function defined there, and any `Tool` it holds, in definition order)."""
    where, _, names = spec.rpartition(":")
    if not where or "/" in names or "\\" in names or names.endswith(".py"):
        where, names = spec, ""
    module = _load_module(where.strip())
    if names.strip():
        chosen = []
        for fn_name in (n.strip() for n in names.split(",") if n.strip()):
            if not hasattr(module, fn_name):
                raise ToolDefinitionError(f"tool spec {spec!r}: {where} has no {fn_name!r}")
            chosen.append(getattr(module, fn_name))
    else:
        chosen = [v for k, v in vars(module).items() if not k.startswith("_") and (
            isinstance(v, Tool) or inspect.isfunction(v) and v.__module__ == module.__name__)]
    if not chosen:
        raise ToolDefinitionError(f"tool spec {spec!r} names no functions")
    tools = []
    for value in chosen:
        if not isinstance(value, Tool) and not callable(value):
            raise ToolDefinitionError(f"tool spec {spec!r}: {value!r} is not a function")
        tools.append(value if isinstance(value, Tool) else tool_from_function(value))
    return tools
