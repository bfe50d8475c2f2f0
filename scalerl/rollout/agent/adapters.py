"""Agents written for TRL and for verl, run by the agent loop as their authors wrote them.

TRL (``GRPOTrainer(environment_factory=MyEnv)``): a class built with no arguments whose ``reset(**row)`` gets
every column of the row by keyword and returns the first observation (text, appended to the prompt's last
message) or None; every public method other than ``reset`` and ``get_reward`` is a tool (its docstring and
type hints describe it to the model); an optional ``get_reward()`` scores the episode from the instance's
state. `is_trl_environment` (environment.py) tells the shape from ``reset``'s ``**kwargs``;
`trl_environment_factory` makes a `TrlEnvironment` per episode, a `ToolEnvironment` over the instance's bound
methods, instances reused across episodes as TRL pools them. TRL's ``tools=[fn, ...]`` functions need no
adapter: `tools_from_module` reads their type hints and Google-style docstrings.

verl (``actor_rollout_ref.rollout.multi_turn.tool_config_path``): a YAML ``tools:`` list, each entry a
``class_name`` (``pkg.module.Class``), its ``config`` and its OpenAI ``tool_schema``; each class shaped as
``verl.tools.base_tool.BaseTool`` (async ``create`` / ``execute`` / ``calc_reward`` / ``release``).
`tools_from_verl_config` builds each class once, as verl does, into a `VerlTool`; in a `ToolEnvironment` every
episode opens its own instance of it (`VerlToolSession`: created at the first call, ``calc_reward`` read when
the episode ends, ``release`` always, errors included), as verl's SGLang rollout kept one per request. verl
itself is not needed: a tool that subclasses verl's ``BaseTool`` imports verl, one written to its interface
does not.

verl's ``@function_tool`` files (``multi_turn.function_tool_path``): `load_function_tools` runs the file as verl's
loader does (verl's own where it is installed, else against a stand-in ``verl.tools.function_tool`` present only
while the file runs, `stand_in_modules`) and returns verl's ``FunctionTool`` entries (what a verl loop gets);
`function_tools_as_tools` makes them scalerl tools, the return rendered as verl renders it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import numbers
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from scalerl.core.errors import UserError
from scalerl.rollout.agent.environment import ToolEnvironment, is_trl_environment
from scalerl.rollout.agent.tools import (
    Tool,
    ToolDefinitionError,
    _load_module,
    tool_from_function,
)

__all__ = ["AttributeDict", "FunctionTool", "TrlEnvironment", "VerlTool", "VerlToolSession", "check_tool_names",
           "function_tools_as_tools", "import_class", "is_trl_environment", "load_function_tools", "stand_in_modules",
           "tools_from_verl_config", "trl_environment_factory", "trl_reset_kwargs", "trl_tools"]


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, awaited if it is async, else in a worker thread (a slow user method never holds the event
    loop the other trajectories decode on)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


# ---- TRL: environment_factory classes -------------------------------------------------------------------------

TRL_RESERVED_METHODS = ("reset", "get_reward")  # TRL calls these itself; never offered to the model


def _trl_tool_methods(instance: Any) -> list[tuple[str, Any]]:
    """The instance's public bound methods other than ``reset`` and ``get_reward``, by name: what TRL's
    ``inspect.getmembers(instance, inspect.ismethod)`` offers, without running property getters to find them."""
    found = []
    for name in sorted(dir(instance)):
        if name.startswith("_") or name in TRL_RESERVED_METHODS:
            continue
        if isinstance(inspect.getattr_static(instance, name, None), property):
            continue
        member = getattr(instance, name, None)
        if inspect.ismethod(member):
            found.append((name, member))
    return found


def trl_tools(instance: Any) -> list[Tool]:
    """The tools a TRL environment instance offers: one per public method, bound to the instance."""
    owner = type(instance).__name__
    tools = []
    for name, method in _trl_tool_methods(instance):
        if not (inspect.getdoc(method) or "").strip():
            raise ToolDefinitionError(
                f"TRL environment {owner}: method {name}() has no docstring. Every public method is offered to the "
                f"model as a tool and its docstring describes it (a summary line, then Args: with a line per "
                f"argument): add one, or rename it _{name} if it is not a tool")
        try:
            tools.append(tool_from_function(method))
        except ToolDefinitionError as error:
            raise ToolDefinitionError(f"TRL environment {owner}: {error}") from error
    return tools


def trl_reset_kwargs(row: dict) -> dict[str, Any]:
    """What TRL passes to ``reset``: the dataset row's columns, the prompt among them (a TRL or verl file's
    columns other than the prompt are under the row's ``columns``)."""
    if isinstance(row.get("columns"), dict):
        return {"prompt": row.get("prompt"), **row["columns"]}
    return dict(row)


class TrlEnvironment(ToolEnvironment):
    """One episode of a TRL environment ``instance``: ``reset(**row)`` first, the model's tool calls run on the
    instance's methods (with any standalone ``tools``), ``get_reward()`` once the episode is over. The instance
    goes back to ``pool`` for a later episode only when this one ended cleanly (a tool that timed out may still
    be running in its thread)."""

    def __init__(self, instance: Any, tools: list[Tool], pool: list[Any] | None = None, parser: str = "hermes",
                 system: str | None = None, max_calls_per_turn: int = 4, max_result_chars: int = 2048):
        super().__init__(tools, parser, system, max_calls_per_turn, max_result_chars)
        self.instance, self.pool, self.ended_cleanly = instance, pool, False

    async def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        owner = type(self.instance).__name__
        self.open_tool_episodes(row)
        observation = await _call(self.instance.reset, **trl_reset_kwargs(row))
        if observation is not None and not isinstance(observation, str):
            raise UserError(f"{owner}.reset returned {type(observation).__name__}: return the first observation as "
                            "a string (appended to the prompt, as TRL does) or None (content blocks and images are "
                            "not supported: scalerl's agent loop is text-only)")
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            messages = [dict(m) for m in prompt]
        else:
            messages = [{"role": "user", "content": str(prompt)}] if prompt else []
        if observation is not None:
            if messages and isinstance(messages[-1].get("content"), str):
                # TRL's rule: the observation is appended to the last message's text, as it is, no separator
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
            else:
                messages.append({"role": "user", "content": observation})
        if not messages:
            raise UserError(f"{owner}.reset returned None and the row has no prompt: return the task as a string "
                            "from reset, or give the rows a prompt")
        if self.system and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        return messages, [t.schema() for t in self.tools.values()]

    async def episode_reward(self) -> float | None:
        """``get_reward()`` where the class has one, plus what the standalone tools score; None for neither."""
        owner = type(self.instance).__name__
        rewards = []
        get_reward = getattr(self.instance, "get_reward", None)
        if callable(get_reward):
            value = await _call(get_reward)
            if not isinstance(value, numbers.Real):
                raise UserError(f"{owner}.get_reward returned {type(value).__name__}: return a float")
            rewards.append(float(value))
        tool_reward = await super().episode_reward()
        if tool_reward is not None:
            rewards.append(tool_reward)
        self.ended_cleanly = self.stats["tool_timeouts"] == 0
        return sum(rewards) if rewards else None

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self.pool is not None and self.ended_cleanly:
                self.ended_cleanly = False
                self.pool.append(self.instance)


def _construct(cls: type) -> Any:
    try:
        return cls()
    except Exception as error:
        raise UserError(f"TRL environment {cls.__name__}(): building it failed ({type(error).__name__}: {error}); "
                        "TRL's environment_factory builds it with no arguments") from error


def trl_environment_factory(cls: type, tools: Iterable[Tool] = (), parser: str = "hermes", system: str | None = None,
                            max_calls_per_turn: int = 4, max_result_chars: int = 2048) -> Callable[[], TrlEnvironment]:
    """A maker of one `TrlEnvironment` per episode over TRL environment class ``cls`` (with standalone
    ``tools`` beside its methods, as TRL composes ``tools`` with ``environment_factory``). One instance is
    built here, as TRL probes one, so a method without a docstring or a type hint fails now, named; instances
    are reused across episodes, as TRL pools them (reset before each)."""
    if not callable(getattr(cls, "reset", None)):
        raise UserError(f"TRL environment {cls.__name__} has no reset method; TRL's environments have "
                        "reset(**kwargs) returning the first observation or None")
    standalone = list(tools)
    probe = _construct(cls)
    methods = trl_tools(probe)
    clash = sorted({t.name for t in standalone} & {t.name for t in methods})
    if clash:
        raise ToolDefinitionError(f"TRL environment {cls.__name__}: tool name {', '.join(clash)} is both one of its "
                                  "methods and a standalone tool; rename one")
    pool = [probe]

    def make() -> TrlEnvironment:
        instance = pool.pop() if pool else _construct(cls)
        bound = [replace(t, function=getattr(instance, t.name)) for t in methods]
        return TrlEnvironment(instance, [*standalone, *bound], pool, parser, system, max_calls_per_turn,
                              max_result_chars)

    return make


# ---- verl: tool config YAML and BaseTool classes --------------------------------------------------------------

VERL_TOOL_CONFIG_SHAPE = ("tools:\n  - class_name: pkg.module.MyTool\n    config: {type: native}\n    tool_schema:\n"
                          "      type: function\n      function: {name: ..., description: ..., parameters: {...}}")


class AttributeDict(dict):
    """A dict that also reads as attributes (``schema.function.name``) and has ``model_dump()``, where verl itself
    is not installed: a tool schema as a tool written against verl's pydantic ``OpenAIFunctionToolSchema`` reads
    it, and verl's trainer config as an agent loop reads its OmegaConf ``DictConfig`` (`verl_loop`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return AttributeDict(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> dict:
        return _plain(self)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _schema_object(schema: dict) -> Any:
    """What verl hands a tool's constructor: its pydantic schema where verl is installed, else an `AttributeDict`."""
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema  # type: ignore[import-not-found]
    except ImportError:
        return AttributeDict(schema)
    return OpenAIFunctionToolSchema.model_validate(schema)


def _schema_dict(schema: Any) -> dict | None:
    """A tool's schema as plain data, from a dict (an `AttributeDict` among them) or verl's pydantic model."""
    if isinstance(schema, dict):
        return _plain(schema)
    if callable(getattr(schema, "model_dump", None)):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    return None


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes: all where it has ``**kwargs``, else the ones it names."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


async def _call_tool_method(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await _call(fn, *args, **_accepted(fn, kwargs))


def _verl_base_default(cls: type, method: str) -> bool:
    """True where ``cls`` inherits ``method`` from verl's own ``BaseTool`` (its ``calc_reward`` is always 0.0)."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return klass.__name__ == "BaseTool" and klass.__module__.startswith("verl.tools")
    return False


def _response_text(response: Any, tool: str) -> Any:
    """A verl tool's answer as the tool message's text: a ``ToolResponse`` (or a dict of its fields) gives its
    ``text``; a string is itself; anything else is left for `call_tool` to render."""
    if response is None or isinstance(response, str):
        return response or ""
    if isinstance(response, dict):
        text, image, video = response.get("text"), response.get("image"), response.get("video")
    elif hasattr(response, "text"):
        text, image, video = response.text, getattr(response, "image", None), getattr(response, "video", None)
    else:
        return response
    if image or video:
        raise ValueError(f"{tool} returned an image or a video; scalerl's agent loop is text-only")
    return text or ""


def _tools_kwargs(row: dict) -> dict[str, Any]:
    """verl's per-row tool arguments: ``tools_kwargs`` ({tool: {create_kwargs, execute_kwargs,
    calc_reward_kwargs, release_kwargs}}), at the top of the row or, as verl's preprocessing writes it, under
    ``extra_info``."""
    found = row.get("tools_kwargs") or (row.get("extra_info") or {}).get("tools_kwargs") or {}
    return found if isinstance(found, dict) else {}


@dataclass
class VerlTool(Tool):
    """A verl tool: the ``BaseTool``-shaped object (built once per run, as verl builds it) under the name and
    schema of its ``tool_schema``. In a `ToolEnvironment` each episode gets its own `VerlToolSession`; called
    alone it creates, executes and releases an instance per call, as verl's agent loop does. ``scores``: its
    ``calc_reward`` is the episode's reward (off for a tool that inherits verl's ``BaseTool.calc_reward``)."""

    base_tool: Any = None
    scores: bool = True

    def __post_init__(self) -> None:
        self.function = self._call_once

    async def _call_once(self, **arguments: Any) -> Any:
        session = self.open_episode({})
        try:
            return await session.function(**arguments)
        finally:
            await session.close()

    def open_episode(self, row: dict) -> VerlToolSession:
        kwargs = _tools_kwargs(row).get(self.name) or {}
        return VerlToolSession(self.name, self.description, self.parameters, None, self.timeout_s, verl_tool=self,
                               kwargs=kwargs if isinstance(kwargs, dict) else {})


@dataclass
class VerlToolSession(Tool):
    """One trajectory's instance of a `VerlTool`: ``create`` at the first call (or when the episode is scored),
    ``execute`` per call, ``calc_reward`` once at the end, ``release`` at close whatever happened. ``kwargs``:
    the row's ``tools_kwargs`` for this tool."""

    verl_tool: VerlTool | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.function = self._execute
        self.step_rewards: list[float] = []
        self._creating: asyncio.Future | None = None

    def _kwargs(self, stage: str) -> dict[str, Any]:
        value = self.kwargs.get(f"{stage}_kwargs") or {}
        return dict(value) if isinstance(value, dict) else {}

    async def _instance_id(self) -> str:
        # One creation shared by the calls of a turn that run side by side; shielded, so a call that times out
        # does not cancel it under the others (close still releases what it created).
        if self._creating is None:
            self._creating = asyncio.ensure_future(self._create())
        return await asyncio.shield(self._creating)

    async def _create(self) -> str:
        base = self.verl_tool.base_tool
        create = getattr(base, "create", None)
        if create is None:
            return str(uuid.uuid4())
        create_kwargs = self._kwargs("create")
        # verl calls create two ways: its SGLang rollout as create(id, **create_kwargs), its agent loop as
        # create(create_kwargs=...); its own tools read either, so both are given (each where it is taken).
        created = await _call_tool_method(create, None, **create_kwargs, create_kwargs=create_kwargs)
        instance_id = created[0] if isinstance(created, tuple) else created
        if instance_id is None:
            raise TypeError(f"{type(base).__name__}.create returned no instance id; return (instance_id, ToolResponse)")
        return instance_id

    async def _execute(self, **arguments: Any) -> Any:
        base = self.verl_tool.base_tool
        instance_id = await self._instance_id()
        result = await _call_tool_method(base.execute, instance_id, arguments, **self._kwargs("execute"))
        response = result
        if isinstance(result, tuple) and len(result) in (2, 3):  # (response, step reward[, metrics])
            response, reward = result[0], result[1]
            if isinstance(reward, numbers.Real):
                self.step_rewards.append(float(reward))
        return _response_text(response, self.name)

    async def episode_reward(self) -> float | None:
        """``calc_reward``'s value where the tool scores episodes and it is a number (verl's search and sandbox
        tools return a list of their step rewards there: not a score, not used)."""
        base = self.verl_tool.base_tool
        calc_reward = getattr(base, "calc_reward", None)
        if not self.verl_tool.scores or calc_reward is None:
            return None
        value = await _call_tool_method(calc_reward, await self._instance_id(), **self._kwargs("calc_reward"))
        return float(value) if isinstance(value, numbers.Real) else None

    async def close(self) -> None:
        if self._creating is None:
            return
        try:
            instance_id = await asyncio.shield(self._creating)
        except Exception:  # noqa: BLE001 - creation failed (and was reported to the call): nothing to release
            return
        finally:
            self._creating = None
        release = getattr(self.verl_tool.base_tool, "release", None)
        if release is not None:
            await _call_tool_method(release, instance_id, **self._kwargs("release"))


def import_class(class_name: str, where: str, search: list[Path], shape: str = VERL_TOOL_CONFIG_SHAPE,
                 key: str = "class_name") -> type:
    """The class ``pkg.module.Class`` names (verl's form), or ``path/file.py:Class`` / ``module:Class``
    (scalerl's). A module not on ``sys.path`` is looked for in ``search`` too (the working directory and the
    YAML's own), as the scalerl command does not put the working directory on the path. ``where`` names the
    entry in errors, ``key`` the field that names the class, ``shape`` the entry's expected form."""
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolDefinitionError(f"{where} has no {key}; {shape}")
    if ":" in class_name:
        module_name, _, name = class_name.rpartition(":")
    else:
        module_name, _, name = class_name.rpartition(".")
    if not module_name or not name:
        raise ToolDefinitionError(f"{where}: {key} {class_name!r} names no module; give it as "
                                  "package.module.Class, as verl does")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            module = _load_module(module_name)
        else:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as error:
                if not error.name or not (module_name + ".").startswith(error.name + "."):
                    raise  # the module was found; something it imports is missing
                added = [str(p) for p in search if str(p) not in sys.path]
                sys.path[:0] = added
                try:
                    module = importlib.import_module(module_name)
                finally:
                    for p in added:
                        sys.path.remove(p)
    except ToolDefinitionError as error:
        raise ToolDefinitionError(f"{where}: {key} {class_name!r}: {error}") from error
    except Exception as error:
        raise ToolDefinitionError(
            f"{where}: {key} {class_name!r}: importing {module_name} failed ({type(error).__name__}: {error}); "
            "run from the directory that holds the package, or add it to PYTHONPATH") from error
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ToolDefinitionError(f"{where}: {key} {class_name!r}: module {module_name} has no class {name}")
    return cls


def _import_tool_class(class_name: str, where: str, search: list[Path]) -> type:
    cls = import_class(class_name, where, search)
    if not callable(getattr(cls, "execute", None)):
        raise ToolDefinitionError(f"{where}: {class_name} has no execute method; a verl tool has async "
                                  "execute(instance_id, parameters, **kwargs) -> (ToolResponse, reward, metrics)")
    return cls


def tools_from_verl_config(path: str | Path, timeout_s: float = 60.0, use_calc_reward: bool = True) -> list[VerlTool]:
    """The tools of verl's tool config YAML at ``path`` (``actor_rollout_ref.rollout.multi_turn.tool_config_path``):
    each entry's class built once as verl builds it, ``cls(config=..., tool_schema=...)``. Each call gets at
    most ``timeout_s``; ``use_calc_reward``: a tool's ``calc_reward`` scores the episode (where the class
    defines its own)."""
    source = Path(path)
    if not source.is_file():
        raise ToolDefinitionError(f"verl tool config {path}: no such file")
    try:
        document = yaml.safe_load(source.read_text())
    except yaml.YAMLError as error:
        raise ToolDefinitionError(f"verl tool config {path} is not valid YAML: {error}") from error
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolDefinitionError(f"verl tool config {path} has no `tools:` list; verl's shape is\n"
                                  f"{VERL_TOOL_CONFIG_SHAPE}")
    tools: list[VerlTool] = []
    for i, entry in enumerate(entries):
        where = f"verl tool config {path}, tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolDefinitionError(f"{where} is {type(entry).__name__}, not a mapping; {VERL_TOOL_CONFIG_SHAPE}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolDefinitionError(f"{where}: config must be a mapping, got {type(config).__name__}")
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolDefinitionError(f"{where}: config.type {kind!r} is not supported; scalerl runs verl's native "
                                      "tools (type: native), not MCP ones yet")
        cls = _import_tool_class(entry.get("class_name"), where, [Path.cwd(), source.resolve().parent])
        given = entry.get("tool_schema")
        if given is not None and not isinstance(given, dict):
            raise ToolDefinitionError(f"{where}: tool_schema must be a mapping, got {type(given).__name__}")
        try:
            base = cls(config=dict(config), tool_schema=None if given is None else _schema_object(given))
        except Exception as error:
            raise ToolDefinitionError(f"{where}: {cls.__name__}(config=..., tool_schema=...) raised "
                                      f"{type(error).__name__}: {error}") from error
        schema = _schema_dict(getattr(base, "tool_schema", None)) or (given and _plain(given))
        if schema is None and callable(getattr(base, "get_openai_tool_schema", None)):
            schema = _schema_dict(base.get_openai_tool_schema())
        function = (schema or {}).get("function") or {}
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolDefinitionError(f"{where}: {cls.__name__} has no tool_schema.function.name; give the "
                                      f"tool_schema in the YAML, as verl's examples do:\n{VERL_TOOL_CONFIG_SHAPE}")
        if any(t.name == name for t in tools):
            raise ToolDefinitionError(f"{where}: a second tool named {name!r}; tool names must differ")
        parameters = function.get("parameters") or {"type": "object", "properties": {}, "required": []}
        scores = use_calc_reward and not _verl_base_default(cls, "calc_reward")
        tools.append(VerlTool(name, str(function.get("description") or ""), parameters, None, timeout_s,
                              base_tool=base, scores=scores))
    return tools


# ---- verl: @function_tool files -------------------------------------------------------------------------------

FUNCTION_TOOL_MODULE = "verl.tools.function_tool"  # where verl's @function_tool decorator lives (v0.9, 0.9.1)
FUNCTION_TOOL_SHAPE = ("from verl.tools.function_tool import function_tool\n\n@function_tool\ndef web_search(query: "
                       "str) -> str:\n    \"\"\"Search the web.\n\n    Args:\n        query: what to look for\n    "
                       "\"\"\"")


@dataclass
class FunctionTool:
    """verl's ``FunctionTool`` (verl/tools/function_tool.py), where verl is not installed: what its registry
    holds for each ``@function_tool`` function and what verl 0.9.1's agent loops receive among their tools."""

    name: str
    fn: Callable[..., Any]
    tool_schema: Any
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)


def _function_tool_schema(fn: Callable[..., Any], name: str) -> dict:
    """The OpenAI schema verl infers (``transformers.utils.get_json_schema``, whose shape `tool_from_function`
    writes) under the decorator's name; verl's refusal of ``*args`` / ``**kwargs``."""
    variadic = [n for n, p in inspect.signature(fn).parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool '{name}' ({fn.__module__}.{fn.__qualname__}) takes *args / **kwargs "
                         f"({', '.join(variadic)}), which an OpenAI tool schema cannot describe: give it named "
                         "parameters")
    return tool_from_function(fn, name).schema()


def _function_tool_shim() -> Any:
    """A module standing in for ``verl.tools.function_tool``: verl's ``function_tool`` decorator (bare,
    ``@function_tool("name")``, ``schema=``), its registry and ``FunctionTool``; a fresh registry per file."""
    import types

    module = types.ModuleType(FUNCTION_TOOL_MODULE)
    registry: dict[str, FunctionTool] = {}

    def function_tool(name: str | Callable[..., Any] | None = None, *, schema: Any = None) -> Any:
        def make(override: str | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
                tool_name = override or fn.__name__
                built = _schema_dict(schema) if schema is not None else _function_tool_schema(fn, tool_name)
                existing = registry.get(tool_name)
                if existing is not None and existing.fn is not fn:
                    raise ValueError(f"Function tool '{tool_name}' is already registered to {existing.fn.__module__}."
                                     f"{existing.fn.__qualname__}; refusing to overwrite with {fn.__module__}."
                                     f"{fn.__qualname__}.")
                registry[tool_name] = FunctionTool(tool_name, fn, _schema_object(built),
                                                   inspect.iscoroutinefunction(fn))
                return fn

            return decorator

        if callable(name) and schema is None:
            return make(None)(name)
        return make(name)

    module.function_tool, module.FunctionTool, module.FUNCTION_TOOL_REGISTRY = function_tool, FunctionTool, registry
    return module


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


@contextlib.contextmanager
def stand_in_modules(modules: dict[str, Any]) -> Iterator[None]:
    """``modules`` (name -> module) in ``sys.modules`` while the block runs, each with empty parent packages
    where those are missing, so a user's file importing verl's names (``from verl.tools.function_tool import
    function_tool``) runs where verl is not installed; all gone again after (what was loaded keeps its
    references)."""
    import types

    added: dict[str, Any] = {}
    for name, module in modules.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules and parent not in added and not _importable(parent):
                added[parent] = types.ModuleType(parent)
                added[parent].__path__ = []  # a package with nothing else in it
        added[name] = module
    for name, module in added.items():  # the fake parents name their children, as an import would
        parent, _, child = name.rpartition(".")
        if parent in added:
            setattr(added[parent], child, module)
    previous = {name: sys.modules.get(name) for name in added}
    sys.modules.update(added)
    try:
        yield
    finally:
        for name, module in previous.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _exec_function_tool_file(path: Path) -> None:
    import importlib.util

    name = "_verl_function_tools_" + str(path).replace("/", "_").replace("\\", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as verl: the file may import its siblings through sys.modules
    spec.loader.exec_module(module)


def load_function_tools(path: str | Path) -> list[Any]:
    """The ``@function_tool`` functions of the Python file at ``path`` (verl's
    ``actor_rollout_ref.rollout.multi_turn.function_tool_path``), as verl's ``load_function_tools_from_path``
    returns them: verl's own loader where verl is installed, else the file runs against a stand-in
    ``verl.tools.function_tool`` (put in ``sys.modules`` while it runs, with ``verl`` and ``verl.tools`` where
    those are missing): the same decorator, the schema from the signature and the Google-style docstring."""
    source = Path(path).expanduser().resolve()
    where = f"function tool file {path}"
    if not source.is_file():
        raise ToolDefinitionError(f"{where}: no such file")
    try:
        verl_module = importlib.import_module(FUNCTION_TOOL_MODULE)
    except Exception:  # noqa: BLE001 - verl not installed (or without its dependencies): the stand-in
        verl_module = None
    if verl_module is not None and callable(getattr(verl_module, "load_function_tools_from_path", None)):
        try:
            found = list(verl_module.load_function_tools_from_path(str(source)))
        except Exception as error:
            raise ToolDefinitionError(f"{where}: loading it raised {type(error).__name__}: {error}") from error
    else:
        shim = _function_tool_shim()
        try:
            with stand_in_modules({FUNCTION_TOOL_MODULE: shim}):
                _exec_function_tool_file(source)
        except ToolDefinitionError as error:
            raise ToolDefinitionError(f"{where}: {error}") from error
        except Exception as error:
            raise ToolDefinitionError(f"{where}: running it raised {type(error).__name__}: {error}") from error
        found = [shim.FUNCTION_TOOL_REGISTRY[name] for name in sorted(shim.FUNCTION_TOOL_REGISTRY)]  # verl's order
    if not found:
        raise ToolDefinitionError(f"{where}: it registers no tool; decorate each tool function with verl's "
                                  f"@function_tool, as in\n{FUNCTION_TOOL_SHAPE}")
    return found


def _function_tool_text(value: Any, tool: str) -> str:
    """A function tool's return as the tool message's text, as verl's ``normalize_function_tool_return`` reads
    it: a ``ToolResponse`` its text, a string itself, a dict as JSON, ``(response[, reward[, metrics]])`` its
    response (the step reward goes, as in verl, to no score), anything else ``str``."""
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(value)}). "
                            "Use (response,), (response, reward), or (response, reward, metrics).")
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if hasattr(value, "text") and type(value).__name__ == "ToolResponse":
        return _response_text(value, tool)
    return str(value)


def function_tools_as_tools(path: str | Path, timeout_s: float = 60.0) -> list[Tool]:
    """The ``@function_tool`` functions of ``path`` as scalerl tools: the schema verl built, called with the
    model's arguments (stateless: ``fn(**arguments)``, as verl calls them), the return as verl renders it."""
    tools = []
    for entry in load_function_tools(path):
        schema = _schema_dict(entry.tool_schema) or {}
        function = schema.get("function") or {}

        async def call(_entry: Any = entry, **arguments: Any) -> str:
            return _function_tool_text(await _entry.call(arguments), _entry.name)

        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        tools.append(Tool(entry.name, str(function.get("description") or ""), parameters, call, timeout_s))
    return tools


def check_tool_names(groups: dict[str, list[Any]]) -> None:
    """verl's rule for its tools (``load_all_tools``): a name used by two tools, across ``tool_config_path`` and
    ``function_tool_path`` (and scalerl's own tools here), is an error naming both sources."""
    seen: dict[str, str] = {}
    for source, tools in groups.items():
        for tool in tools:
            if tool.name in seen:
                raise ToolDefinitionError(f"tool name {tool.name!r} is declared by {seen[tool.name]} and by {source}; "
                                          "each tool name must be unique: rename one")
            seen[tool.name] = source
