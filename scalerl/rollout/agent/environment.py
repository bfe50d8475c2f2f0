"""Environments a user writes at the message level, and the two built in.

An environment is a class with ``reset(row) -> messages`` (or ``(messages, tools)``: tool JSON schemas for the
chat template), ``step(assistant_message) -> EnvStep`` (or a ``(messages, reward, done, info)`` tuple) and an
optional ``close()``; each method plain or ``async`` (plain ones run in a thread pool, so a slow one never
holds the other trajectories). It is named in the config as ``module:Class`` or ``path/file.py:Class``
(`environment_class`), built once per trajectory with the row's ``env_kwargs`` (verl's ``interaction_kwargs``
go there too). The escape hatch for users who drive generation themselves: a class with ``run(generate, row)``
(and no ``step``) gets an async ``generate(prompt_ids, max_new_tokens=None)`` returning the sampled segment and
returns a `scalerl.rollout.agent.loop.TokenEpisode`, checked token for token against what the engine saw.
It may also have ``episode_reward()``, called once when the episode ends (not after an error), before
``close()``: a number there is the episode's reward. Built in: `ToolEnvironment` (tools from
plain Python functions: the model calls them, in its tool-call format, until it answers without a call) and
`ChatEnvironment` (scripted user turns). A TRL environment (`is_trl_environment`) is run through
`adapters.TrlEnvironment`.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl.core.errors import UserError


@dataclass
class EnvStep:
    """What an environment answers to an assistant message: the messages that follow (role ``tool`` or
    ``user``), its reward where it gives one (None: the run's reward function scores the trajectory), whether
    the episode is over, and anything to log or hand to the reward."""

    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def as_env_step(value: Any) -> EnvStep:
    """An `EnvStep` from what ``step`` returned: one already, or the tuple ``(messages, reward, done, info)``."""
    if isinstance(value, EnvStep):
        return value
    if isinstance(value, tuple) and len(value) in (3, 4):
        messages, reward, done, *info = value
        return EnvStep(list(messages or []), reward, bool(done), dict(info[0]) if info and info[0] else {})
    raise TypeError(f"step returned {type(value).__name__}; return an EnvStep or (messages, reward, done, info)")


async def call_env(env: Any, method: str, *args: Any) -> Any:
    """``env.method(*args)``, awaited if async, else in a worker thread (a plain environment that sleeps or
    computes never blocks the event loop the other trajectories decode on)."""
    fn = getattr(env, method)
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.to_thread(fn, *args)


def is_trl_environment(cls: type) -> bool:
    """TRL's ``environment_factory`` shape: ``reset(**row)`` (it takes ``**kwargs``, as TRL passes every column
    of the row by keyword), its public methods the tools, an optional ``get_reward()``. A scalerl environment's
    ``reset(row)`` takes the row as one argument."""
    try:
        parameters = inspect.signature(cls.reset).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in parameters)


def environment_class(spec: str) -> type:
    """The class ``spec`` names: ``package.module:Class`` or ``path/to/file.py:Class``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UserError(f"environment {spec!r}: give it as module:Class or path/to/file.py:Class")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UserError(f"environment {spec!r}: file {where} not found")
            module_name = f"scalerl_env_{abs(hash(str(path.resolve())))}"
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as error:  # the user's module raised on import: say which and why
        raise UserError(f"environment {spec!r}: importing {where} failed: {type(error).__name__}: {error}") from error
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise UserError(f"environment {spec!r}: {where} has no class {name}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    token_level = callable(getattr(cls, "run", None)) and not callable(getattr(cls, "step", None))
    if missing and not is_trl_environment(cls) and not token_level:
        raise UserError(f"environment {spec!r}: {name} has no {' or '.join(missing)} method "
                        "(an environment has reset(row) and step(assistant_message); a TRL environment has "
                        "reset(**kwargs) and its tools as public methods; a token-level one run(generate, row))")
    return cls


class ToolEnvironment:
    """The model answers with tool calls (in ``parser``'s format) until it answers without one: each call runs
    (validated against the tool's schema, with its timeout; an unknown tool, bad arguments, a raise or a
    timeout become the tool message's error text, counted in ``info``), and the results come back as one
    ``tool`` message per call. The prompt is the row's ``prompt`` (text: one user message; or messages), with
    an optional ``system`` message."""

    def __init__(self, tools: list[Any], parser: str = "hermes", system: str | None = None,
                 max_calls_per_turn: int = 4, max_result_chars: int = 2048):
        from scalerl.rollout.agent.tool_calls import get_parser

        self.tool_definitions = list(tools)
        self.tools = {t.name: t for t in tools}
        self.sessions: list[Any] = []  # the tools' per-episode states (`open_episode`)
        self.parser, self.system = get_parser(parser), system
        self.max_calls_per_turn, self.max_result_chars = max_calls_per_turn, max_result_chars
        self.stats = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_s": 0.0,
                      "tool_s_by_name": {}}  # name -> [seconds, calls]: the doctor names the slowest tool

    def open_tool_episodes(self, row: dict) -> None:
        """A tool with ``open_episode(row)`` (a verl tool: an instance of its own per trajectory) is replaced, for
        this episode, by what that returns: a tool with async ``episode_reward()`` and ``close()``."""
        self.sessions = [t.open_episode(row) for t in self.tool_definitions if hasattr(t, "open_episode")]
        self.tools = {t.name: t for t in self.tool_definitions}
        self.tools.update({s.name: s for s in self.sessions})

    def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        self.open_tool_episodes(row)
        prompt = row["prompt"]
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.system and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system})
        return messages, [t.schema() for t in self.tools.values()]

    async def step(self, message: dict) -> EnvStep:
        from scalerl.rollout.agent.tools import ToolResult, call_tool

        parsed = self.parser.parse(message.get("content", ""))
        if not parsed.calls and not parsed.errors:
            return EnvStep(done=True, info=dict(self.stats))
        replies = [f"error: {e}" for e in parsed.errors]
        self.stats["tool_errors"] += len(parsed.errors)
        calls = parsed.calls[: self.max_calls_per_turn]
        if len(parsed.calls) > len(calls):
            replies.append(f"error: {len(parsed.calls)} tool calls in one turn; at most {self.max_calls_per_turn} run")
            self.stats["tool_errors"] += 1

        async def run(call) -> ToolResult:
            tool = self.tools.get(call.name)
            if tool is None:
                return ToolResult(f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(self.tools))})",
                                  error=True)
            return await call_tool(tool, call.arguments, max_chars=self.max_result_chars)

        results = await asyncio.gather(*(run(c) for c in calls))  # one turn's calls run side by side
        for call, result in zip(calls, results):
            self.stats["tool_calls"] += 1
            self.stats["tool_errors"] += int(result.error)
            self.stats["tool_timeouts"] += int(result.timed_out)
            self.stats["tool_s"] += result.seconds
            if call.name in self.tools:
                spent = self.stats["tool_s_by_name"].setdefault(call.name, [0.0, 0])
                spent[0], spent[1] = spent[0] + result.seconds, spent[1] + 1
            replies.append(result.content)
        return EnvStep([{"role": "tool", "content": r} for r in replies], info=dict(self.stats))

    async def episode_reward(self) -> float | None:
        """The sum of the rewards the episode's tools give (a verl tool's ``calc_reward``); None when none does."""
        rewards = [r for r in await asyncio.gather(*(s.episode_reward() for s in self.sessions)) if r is not None]
        return float(sum(rewards)) if rewards else None

    async def close(self) -> None:
        """Every tool's episode closed (a verl tool's instance released), even where another one fails."""
        results = await asyncio.gather(*(s.close() for s in self.sessions), return_exceptions=True)
        self.sessions = []
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]


class ChatEnvironment:
    """A multi-turn chat: the row's ``turns`` (user messages after the first prompt) come one per assistant
    answer; the episode ends after the last one is answered."""

    def __init__(self):
        self.turns: list[str] = []

    def reset(self, row: dict) -> list[dict]:
        self.turns = [str(t) for t in row.get("turns", [])]
        prompt = row["prompt"]
        return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]

    def step(self, message: dict) -> EnvStep:
        if not self.turns:
            return EnvStep(done=True)
        return EnvStep([{"role": "user", "content": self.turns.pop(0)}])
