"""verl's interactions (``BaseInteraction`` user simulators) as the user of scalerl's tool environment.

verl's ``ToolAgentLoop`` (up to v0.7.1; verl removed ``verl/interactions`` in v0.8) read
``actor_rollout_ref.rollout.multi_turn.interaction_config_path``, a YAML ``interaction:`` list (each a
``class_name``, its ``config`` and an optional ``name``: by default the class name without ``Interaction``,
lower-cased), built each class once per worker as ``cls(config={..., "name": name})``, and ran a row's
interaction, the one its ``extra_info.interaction_kwargs["name"]`` names: ``start_interaction(request_id,
**interaction_kwargs)`` when the episode starts; after each model turn without a tool call,
``generate_response(request_id, messages, **interaction_kwargs) -> (should_terminate, response, score,
metadata)``, its response the next user message and its score the turn's. `VerlInteractions` reads the YAML as
verl did; `InteractionEnvironment` is scalerl's tool environment (tools optional) with the interaction as the
user: an episode ends when it says ``should_terminate``, the model's turns run out, or the budget does; its reward
is the last turn's score (plus what its verl tools' ``calc_reward`` give), the turn scores logged.
``finalize_interaction(instance_id)`` is called when the episode closes, whatever ended it (verl's loop never
called it); ``calculate_score`` is the interaction's own helper (verl's loop never called it either: verl's
``Gsm8kInteraction`` calls it from ``generate_response``).
"""

from __future__ import annotations

import inspect
import numbers
import uuid
from pathlib import Path
from typing import Any

import yaml

from scalerl.core.errors import UserError
from scalerl.rollout.agent.adapters import (
    _call,
    _importable,
    _plain,
    import_class,
    stand_in_modules,
)
from scalerl.rollout.agent.environment import EnvStep, ToolEnvironment
from scalerl.rollout.agent.tools import ToolDefinitionError

__all__ = ["InteractionEnvironment", "VerlInteractionError", "VerlInteractions", "interaction_kwargs"]

INTERACTION_CONFIG_SHAPE = ("interaction:\n  - name: gsm8k                      # what rows' interaction_kwargs.name "
                            "say\n    class_name: pkg.module.MyInteraction\n    config: {}")
INTERACTION_METHODS = ("start_interaction", "generate_response")  # what verl's loop called
INTERACTION_BASE_MODULE = "verl.interactions.base"  # where verl (<= 0.7.1) kept BaseInteraction


class BaseInteraction:
    """verl's ``BaseInteraction`` (verl <= 0.7.1), for an interaction file that subclasses it where verl is not
    installed or no longer has it (v0.8 on): importable as ``verl.interactions.base`` while the file loads, with the
    defaults a subclass falls back on (a fresh instance id, an accepting reply scored 0.8, no score, nothing to
    release)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id if instance_id is not None else str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self) -> float:
        return 0.0

    async def finalize_interaction(self) -> None:
        return None


def _base_interaction_module() -> Any:
    import types

    module = types.ModuleType(INTERACTION_BASE_MODULE)
    module.BaseInteraction = BaseInteraction
    return module


class VerlInteractionError(UserError, ValueError):
    """An interaction config or class that cannot be used, or a row naming no configured interaction."""


def interaction_kwargs(row: dict) -> dict[str, Any]:
    """A row's ``interaction_kwargs``, where verl's preprocessing writes them (``extra_info``) or at the top."""
    extra_info = row.get("extra_info") or (row.get("columns") or {}).get("extra_info") or {}
    found = extra_info.get("interaction_kwargs") if isinstance(extra_info, dict) else None
    found = found if found is not None else row.get("interaction_kwargs")
    return dict(found) if isinstance(found, dict) else {}


def _default_name(class_name: str) -> str:
    simple = class_name.replace(":", ".").split(".")[-1]
    return (simple.removesuffix("Interaction")).lower()


class VerlInteractions:
    """The interactions of verl's interaction YAML at ``path``, each class built once (as verl's worker built
    them); `get` is the one a row names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise VerlInteractionError(f"verl interaction config {path}: no such file")
        try:
            document = yaml.safe_load(self.path.read_text())
        except yaml.YAMLError as error:
            raise VerlInteractionError(f"verl interaction config {path} is not valid YAML: {error}") from error
        entries = document.get("interaction") if isinstance(document, dict) else None
        if not isinstance(entries, list) or not entries:
            raise VerlInteractionError(f"verl interaction config {path} has no `interaction:` list; verl's shape is\n"
                                       f"{INTERACTION_CONFIG_SHAPE}")
        self.interactions: dict[str, Any] = {}
        # verl's BaseInteraction where the installed verl has it, else scalerl's while the classes are imported
        shim = {} if _importable(INTERACTION_BASE_MODULE) else {INTERACTION_BASE_MODULE: _base_interaction_module()}
        with stand_in_modules(shim):
            for i, entry in enumerate(entries):
                self._add(i, entry)

    def _add(self, i: int, entry: Any) -> None:
        """Entry ``i``'s class imported and built, under its name."""
        search = [Path.cwd(), self.path.resolve().parent]
        where = f"verl interaction config {self.path}, interaction[{i}]"
        if not isinstance(entry, dict):
            raise VerlInteractionError(f"{where} is {type(entry).__name__}, not a mapping; verl's shape is\n"
                                       f"{INTERACTION_CONFIG_SHAPE}")
        try:
            cls = import_class(entry.get("class_name"), where, search, INTERACTION_CONFIG_SHAPE)
        except ToolDefinitionError as error:
            raise VerlInteractionError(str(error)) from error
        missing = [m for m in INTERACTION_METHODS if not callable(getattr(cls, m, None))]
        if missing:
            raise VerlInteractionError(f"{where}: {cls.__name__} has no {' or '.join(missing)}; a verl interaction "
                                       "subclasses verl's BaseInteraction (async start_interaction, "
                                       "generate_response, calculate_score, finalize_interaction)")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise VerlInteractionError(f"{where}: config must be a mapping, got {type(config).__name__}")
        name = str(entry.get("name") or _default_name(entry["class_name"]))
        if name in self.interactions:
            raise VerlInteractionError(f"{where}: a second interaction named {name!r}; each interaction must have "
                                       "a unique name")
        try:
            self.interactions[name] = cls(config={**_plain(config), "name": name})
        except Exception as error:
            raise VerlInteractionError(f"{where}: {cls.__name__}(config=...) raised {type(error).__name__}: "
                                       f"{error}") from error

    def get(self, kwargs: dict[str, Any]) -> Any:
        """The interaction ``kwargs["name"]`` names (verl's rule: the name is required)."""
        known = ", ".join(sorted(self.interactions))
        if "name" not in kwargs:
            raise VerlInteractionError(f"the row's extra_info.interaction_kwargs has no 'name'; name one of the "
                                       f"interactions of {self.path} ({known}), as verl requires")
        interaction = self.interactions.get(str(kwargs["name"]))
        if interaction is None:
            raise VerlInteractionError(f"the row's interaction_kwargs.name {kwargs['name']!r} is not in {self.path} "
                                       f"(interactions: {known}); add it there or fix the row's name")
        return interaction


def _takes_instance_id(fn: Any) -> bool:
    """Whether ``fn`` takes an instance id (verl's ``Gsm8kInteraction.finalize_interaction(instance_id)``), or
    nothing (``BaseInteraction.finalize_interaction(self)``)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


class InteractionEnvironment(ToolEnvironment):
    """scalerl's tool environment with a verl interaction as the user: a turn with tool calls runs them, a turn
    without one goes to the row's interaction, whose response is the next user message (its score the turn's
    reward) until it says ``should_terminate``. ``tools`` may be empty (a pure user simulator)."""

    def __init__(self, interactions: VerlInteractions, tools: list[Any], parser: str = "hermes",
                 system: str | None = None, max_calls_per_turn: int = 4, max_result_chars: int = 2048):
        super().__init__(tools, parser, system, max_calls_per_turn, max_result_chars)
        self.interactions = interactions
        self.interaction: Any = None
        self.instance_id: str | None = None
        self.kwargs: dict[str, Any] = {}
        self.messages: list[dict] = []
        self.turn_scores: list[float] = []

    async def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        messages, schemas = super().reset(row)
        self.kwargs = interaction_kwargs(row)
        interaction = self.interactions.get(self.kwargs)
        # verl: start_interaction(request_id, **interaction_kwargs); the id it returns names the instance
        started = await _call(interaction.start_interaction, uuid.uuid4().hex, **self.kwargs)
        self.interaction, self.instance_id = interaction, str(started)
        self.messages, self.turn_scores = list(messages), []
        return messages, schemas

    async def step(self, message: dict) -> EnvStep:
        self.messages.append({"role": "assistant", "content": message.get("content", "")})
        if self.tools:
            parsed = self.parser.parse(message.get("content", ""))
            if parsed.calls or parsed.errors:  # a tool turn: the tools answer, not the user
                step = await super().step(message)
                self.messages.extend(step.messages)
                return step
        result = await _call(self.interaction.generate_response, self.instance_id, list(self.messages), **self.kwargs)
        name = type(self.interaction).__name__
        if not isinstance(result, tuple) or len(result) != 4:
            raise VerlInteractionError(f"{name}.generate_response returned {type(result).__name__}; return verl's "
                                       "(should_terminate, response, score, metadata)")
        terminate, response, score, metadata = result
        if score is not None and not isinstance(score, numbers.Real):
            raise VerlInteractionError(f"{name}.generate_response's score is {type(score).__name__}; give a float "
                                       "or None")
        if score is not None:
            self.turn_scores.append(float(score))
        reply = {"role": "user", "content": "" if response is None else str(response)}
        self.messages.append(reply)
        info = {**self.stats, "turn_scores": list(self.turn_scores),
                "interaction_metadata": metadata if isinstance(metadata, dict) else {}}
        return EnvStep([reply], None if score is None else float(score), bool(terminate), info)

    async def episode_reward(self) -> float | None:
        """The interaction's last score (the turn scores are in the episode's info) plus its verl tools'
        ``calc_reward``; None where neither gave one (the run's reward function then scores the episode)."""
        tools = await super().episode_reward()
        parts = [r for r in (self.turn_scores[-1] if self.turn_scores else None, tools) if r is not None]
        return float(sum(parts)) if parts else None

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            interaction, self.interaction = self.interaction, None
            finalize = getattr(interaction, "finalize_interaction", None)
            if callable(finalize):
                await (_call(finalize, self.instance_id) if _takes_instance_id(finalize) else _call(finalize))


def interaction_environment_factory(agent_cfg: Any, tools: list[Any]) -> Any:
    """A maker of one `InteractionEnvironment` per episode over ``rollout.agent.interaction_config`` (read now, so
    a class that does not exist fails at start-up) and ``tools``."""
    interactions = VerlInteractions(agent_cfg.interaction_config)
    return lambda: InteractionEnvironment(interactions, tools, agent_cfg.tool_parser, agent_cfg.system,
                                          agent_cfg.max_tool_calls_per_turn)
