"""verl agent loops (``AgentLoopBase`` subclasses) run as their authors wrote them, on scalerl's engine.

verl builds one loop instance per sample, ``Loop(trainer_config=..., server_manager=..., tokenizer=...,
processor=..., dataset_cls=..., dataset_config=..., **entry_kwargs)``, and awaits
``run(sampling_params, **row_fields) -> AgentLoopOutput``; the loop asks the server manager for each turn
(``await server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`` -> ``TokenOutput``:
``token_ids``, ``log_probs``) and returns the prompt and the response with its mask (1 on the engine's tokens,
0 on tool results and user turns, and on sampled tokens the loop keeps out of the loss: they stay in the
trajectory with their log-probs, untrained; a turn's own ``stop_token_ids`` reach the engine). Here that loop is
a token-level environment (`loop.TokenEpisode`'s ``run(generate, row)``, the agent loop's escape hatch): `VerlServerManager` answers ``generate`` from the
continuous engine through the episode's ``generate``, and `episode_from_output` maps the loop's output back to
the segments ``generate`` returned, so `loop.check_token_episode` holds it to what the engine saw and sampled.

The loop is picked per row as verl picks it: the row's ``agent_name`` names a loop registered with verl's
``@register(name)`` (read from verl's registry once the loop's module is imported, verl installed or a module
of the same shape), listed in verl's agent loop config YAML (``- name: ..., _target_: pkg.module.Class``), or
the one class ``rollout.agent.verl_loop`` names; a row without one runs ``rollout.agent.verl_default_loop``
(or that one class). ``run`` gets the row's fields as verl's ``RLHFDataset`` gives them: ``raw_prompt`` (the
messages), ``extra_info``, ``index``, ``tools_kwargs``, ``interaction_kwargs`` and the row's other columns.

What a loop reads of verl's trainer config (``self.config``) is built from scalerl's keys (`verl_trainer_config`):
``actor_rollout_ref.rollout.{prompt_length, response_length, temperature, top_p, top_k, multi_turn.*}``,
``data.*``, the model path; an OmegaConf ``DictConfig`` where omegaconf is installed, else an `AttributeDict`.
Text only: no processor, and a turn with images or video is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scalerl.core.errors import UserError
from scalerl.rollout.agent.adapters import (
    AttributeDict,
    _accepted,
    _tools_kwargs,
    check_tool_names,
    import_class,
    load_function_tools,
    tools_from_verl_config,
)
from scalerl.rollout.agent.loop import AgentLimits, EpisodeLimit, TokenEpisode
from scalerl.rollout.agent.tools import ToolDefinitionError
from scalerl.rollout.trajectory import TrajectorySegment

__all__ = ["HFStyleTokenizer", "VerlLoopEnvironment", "VerlLoops", "VerlServerManager", "episode_from_output",
           "verl_loop_factory", "verl_run_kwargs", "verl_trainer_config"]

VERL_REGISTRY_MODULE = "verl.experimental.agent_loop.agent_loop"  # where verl's @register keeps its loops
LOOP_CONFIG_SHAPE = "- name: my_agent\n  _target_: pkg.module.MyAgentLoop   # plus any constructor arguments"
OUTPUT_FIELDS = ("prompt_ids", "response_ids", "response_mask")  # what an AgentLoopOutput must have
# Sampling keys a loop may pass to generate: the ones the step's sampling already fixes (checked equal), the ones
# scalerl's engine has no use for, and the turn's token limit.
FIXED_SAMPLING = ("temperature", "top_p", "top_k")
IGNORED_SAMPLING = {"logprobs": None, "repetition_penalty": 1.0, "n": 1, "detokenize": None, "stop_token_ids": None,
                    "stop": None}  # the stops: handed to the engine (ids) or refused (strings) by _extra_stops
LIMIT_SAMPLING = ("max_tokens", "max_new_tokens")


class VerlLoopError(UserError, ValueError):
    """A verl agent loop that cannot be found or built, or returned what the engine did not produce."""


@dataclass
class TokenOutput:
    """verl's ``TokenOutput`` (verl/workers/rollout/replica.py), where verl is not installed."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None


def _token_output(**fields: Any) -> Any:
    """verl's own pydantic ``TokenOutput`` when verl's rollout module is loaded (a loop may check the type), else
    the stand-in."""
    replica = sys.modules.get("verl.workers.rollout.replica")
    cls = getattr(replica, "TokenOutput", None) or TokenOutput
    return cls(**fields)


class HFStyleTokenizer:
    """scalerl's tokenizer as verl's agent loops call a ``transformers`` tokenizer: ``apply_chat_template``
    tokenizes by default and returns the ids (``tokenize=False``: the text), ``encode(text,
    add_special_tokens=...)`` and ``decode(ids, skip_special_tokens=...)``; anything else is the wrapped
    tokenizer's. scalerl's ``encode`` adds no special tokens, as ``apply_chat_template`` tokenizes in
    ``transformers`` (the template writes them)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.padding_side = "left"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = False,
                            **kwargs: Any) -> Any:
        for unused in ("padding", "truncation", "max_length", "return_tensors", "documents", "chat_template"):
            if kwargs.pop(unused, None) not in (None, False):
                raise VerlLoopError(f"apply_chat_template({unused}=...) is not supported by scalerl's tokenizer; "
                                    "call it with the messages, tools and add_generation_prompt")
        text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                                  **({"tools": tools} if tools else {}), **kwargs)
        if not tokenize:
            return text
        ids = self.tokenizer.encode(text)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, list[int]]:
        ids = self.encode(text)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


class VerlServerManager:
    """What a verl agent loop calls ``self.server_manager``: ``await generate(request_id, prompt_ids=...,
    sampling_params=...)`` samples one turn on scalerl's engine (through the episode's ``generate``: its seed per
    turn, the key/value prefix of the last turn reused) and returns verl's ``TokenOutput`` with the engine's ids
    and log-probs. A turn gets at most what is left of ``response_length`` (the response so far counted from the
    episode's first prompt), so a loop that cuts its response there never cuts a sampled turn. ``calls``: each
    turn's prompt and the segment the engine returned, in order."""

    def __init__(self, generate: Callable[..., Any], response_length: int, sampling: dict[str, Any], loop: str,
                 stop_token_ids: tuple[int, ...] = ()):
        self._generate, self.response_length, self.sampling, self.loop = generate, response_length, sampling, loop
        self.stop_token_ids = set(stop_token_ids)
        self.calls: list[tuple[list[int], TrajectorySegment]] = []

    def _turn_limit(self, sampling_params: dict[str, Any]) -> int | None:
        for key in FIXED_SAMPLING:
            if key in sampling_params and sampling_params[key] != self.sampling[key]:
                raise VerlLoopError(
                    f"verl agent loop {self.loop} asked generate for {key}={sampling_params[key]!r}; scalerl samples "
                    f"every turn with the run's rollout.{key}={self.sampling[key]!r}: pass the sampling_params run() "
                    "was given, and set rollout.* for the run")
        unknown = sorted(k for k in sampling_params if k not in (*FIXED_SAMPLING, *IGNORED_SAMPLING, *LIMIT_SAMPLING))
        changed = [k for k, v in IGNORED_SAMPLING.items() if v is not None and sampling_params.get(k, v) != v]
        if unknown or changed:
            raise VerlLoopError(f"verl agent loop {self.loop} asked generate for {', '.join(unknown + changed)}, "
                                "which scalerl's engine does not apply (it samples with temperature, top_p, top_k "
                                "and a token limit, max_tokens); leave them out")
        limits = [int(sampling_params[k]) for k in LIMIT_SAMPLING if sampling_params.get(k) is not None]
        return min(limits) if limits else None

    def _extra_stops(self, sampling_params: dict[str, Any]) -> tuple[int, ...]:
        """The turn's stop token ids besides the run's (verl 0.9.1's tool parsers add their own, Gemma 4's
        tool-call end), handed to the engine for this turn. Stop strings are refused: the engine matches ids."""
        if sampling_params.get("stop"):
            raise VerlLoopError(f"verl agent loop {self.loop} asked generate to stop at the strings "
                                f"{sampling_params['stop']!r}; scalerl's engine stops at token ids only: pass "
                                "stop_token_ids (tokenizer.convert_tokens_to_ids of a single-token stop) instead")
        given = sampling_params.get("stop_token_ids") or ()
        given = given.tolist() if hasattr(given, "tolist") else list(given)
        if not all(isinstance(t, numbers.Integral) and int(t) >= 0 for t in given):
            raise VerlLoopError(f"verl agent loop {self.loop} asked generate for stop_token_ids={given!r}; give "
                                "token ids (non-negative integers)")
        return tuple(dict.fromkeys(int(t) for t in given if int(t) not in self.stop_token_ids))

    async def generate(self, request_id: Any, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None, **_: Any) -> Any:
        if image_data or video_data or audio_data:
            raise VerlLoopError(f"verl agent loop {self.loop} passed images, video or audio to generate; scalerl's agent "
                                "loop is text-only")
        params = dict(sampling_params or {})
        wanted, stops = self._turn_limit(params), self._extra_stops(params)
        prompt = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        first = self.calls[0][0] if self.calls else prompt
        used = len(prompt) - len(first) if prompt[: len(first)] == first else 0
        left = self.response_length - used
        if left <= 0:
            raise EpisodeLimit(f"verl agent loop {self.loop}: the response already holds {used} tokens of "
                               f"actor_rollout_ref.rollout.response_length={self.response_length}")
        segment = await self._generate(prompt, max_new_tokens=min(left, wanted or left),
                                       **({"stop_token_ids": stops} if stops else {}))
        self.calls.append((prompt, segment))
        return _token_output(token_ids=list(segment.token_ids), log_probs=list(segment.logprobs or []),
                             stop_reason="completed")


def _field(output: Any, name: str, loop: str, required: bool = True) -> Any:
    if isinstance(output, dict):
        present, value = name in output, output.get(name)
    else:
        present, value = hasattr(output, name), getattr(output, name, None)
    if required and (not present or value is None):
        raise VerlLoopError(f"verl agent loop {loop} returned {type(output).__name__} without {name}; return verl's "
                            "AgentLoopOutput(prompt_ids=..., response_ids=..., response_mask=..., ...)")
    return value.tolist() if hasattr(value, "tolist") else value


def _plain(value: Any) -> Any:
    """verl's pydantic metrics and extra fields as plain data, for the episode's info."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def episode_from_output(loop: str, output: Any, calls: list[tuple[list[int], TrajectorySegment]]) -> TokenEpisode:
    """A verl loop's ``AgentLoopOutput`` as the episode's prompt and segments: each turn the server manager
    returned is found where it was sampled (its prompt is ``prompt_ids`` + the response before it) and kept as
    that very segment (`check_token_episode` then holds each to the prompt it was sampled on); what lies between
    turns is context and must be masked 0. ``response_mask`` may be 0 on a sampled token too, as verl lets a loop
    keep a turn (or part of one) out of the loss: the token stays in the trajectory with its log-prob, untrained
    (the segment's ``loss_mask``). ``reward_score`` is the episode's reward (None: the run's reward function
    scores it); ``num_turns``, ``extra_fields`` and ``metrics`` go to its info. The engine's log-probs are
    trained; the loop's ``response_logprobs`` are only checked for length."""
    prompt = [int(t) for t in _field(output, "prompt_ids", loop)]
    response = [int(t) for t in _field(output, "response_ids", loop)]
    mask = [int(m) for m in _field(output, "response_mask", loop)]
    logprobs = _field(output, "response_logprobs", loop, required=False)
    if len(mask) != len(response) or (logprobs is not None and len(logprobs) not in (0, len(response))):
        have = "" if logprobs is None else f", response_logprobs {len(logprobs)}"
        raise VerlLoopError(f"verl agent loop {loop} returned response_ids of {len(response)} tokens, response_mask "
                            f"of {len(mask)}{have}: give one mask value (and one log-prob) per response token")
    if any(m not in (0, 1) for m in mask):
        raise VerlLoopError(f"verl agent loop {loop}: response_mask holds {sorted(set(mask) - {0, 1})}; it is 1 on "
                            "the engine's tokens and 0 on tool results and user turns")

    def context(start: int, stop: int, before: str) -> None:
        sampled = next((q for q in range(start, stop) if mask[q] == 1), None)
        if sampled is not None:
            raise VerlLoopError(f"verl agent loop {loop}: response_mask marks response token {sampled} as sampled, "
                                f"but {before}; mask 0 what the engine did not sample")
        if stop > start:
            segments.append(response[start:stop])

    segments: list[Any] = []
    masks: list[list[int] | None] = []
    p = 0
    for k, (sampled_on, segment) in enumerate(calls):
        at, n = len(sampled_on) - len(prompt), len(segment.token_ids)
        if at >= len(response) and n and sampled_on[: len(prompt)] == prompt:  # the turn is not in the response
            raise VerlLoopError(
                f"verl agent loop {loop}: generate returned {len(calls)} turns and response_ids holds {k} of them; "
                "scalerl keeps every turn the engine sampled: keep each in the response (response_mask 0 keeps one "
                "out of the loss)")
        if k and at < p:  # sampled again on an earlier prompt: the turn before it was dropped
            raise VerlLoopError(
                f"verl agent loop {loop}: turn {k + 1} was sampled on a prompt that ends before turn {k} does (token "
                f"{at} of the response, turn {k} ends at {p}); scalerl keeps every turn the engine sampled: keep each "
                "in the conversation (response_mask 0 keeps one out of the loss)")
        expected = prompt + response[:max(at, 0)]
        if sampled_on != expected:
            differ = next((i for i, (a, b) in enumerate(zip(sampled_on, expected)) if a != b),
                          min(len(sampled_on), len(expected)))
            raise VerlLoopError(
                f"verl agent loop {loop}: turn {k + 1} was sampled on a prompt of {len(sampled_on)} tokens that is not "
                f"prompt_ids + the response before it (they differ at token {differ}); prompt each turn with "
                "prompt_ids + response_ids so far, as they were sampled (not re-rendered)")
        context(p, at, f"it comes before turn {k + 1}, which starts at {at}")
        if response[at:at + n] != segment.token_ids:
            raise VerlLoopError(
                f"verl agent loop {loop}: response tokens {at}..{at + n - 1} are not the {n} tokens generate returned "
                f"for turn {k + 1}; put each turn's token_ids in response_ids as they came (not cut, not "
                "re-tokenized)")
        turn_mask = mask[at:at + n]
        masks.append(turn_mask if 0 in turn_mask else None)
        segments.append(segment)
        p = at + n
    context(p, len(response), f"the {len(calls)} turn(s) generate returned come before it")
    for (_, segment), turn_mask in zip(calls, masks):  # set once the whole output holds
        segment.loss_mask = turn_mask
    reward = _field(output, "reward_score", loop, required=False)
    if reward is not None and not isinstance(reward, numbers.Real):
        raise VerlLoopError(f"verl agent loop {loop}: reward_score is {type(reward).__name__}; give a float or None")
    info = {"verl_loop": loop, "verl_num_turns": _field(output, "num_turns", loop, required=False),
            "verl_extra_fields": _plain(_field(output, "extra_fields", loop, required=False) or {}),
            "verl_metrics": _plain(_field(output, "metrics", loop, required=False) or {})}
    return TokenEpisode(prompt, segments, None if reward is None else float(reward), info)


def verl_run_kwargs(row: dict) -> tuple[str | None, dict[str, Any]]:
    """A scalerl row as the fields verl's ``RLHFDataset`` hands ``run``: the row's ``agent_name`` (picked off, as
    verl passes it to the worker, not the loop) and the keyword arguments."""
    columns = row.get("columns") if isinstance(row.get("columns"), dict) else {
        k: v for k, v in row.items() if k not in ("prompt", "columns")}
    kwargs = dict(columns)
    for key in ("data_source", "ability", "reward_model"):
        if row.get(key) is not None:
            kwargs.setdefault(key, row[key])
    extra_info = row.get("extra_info") or kwargs.get("extra_info") or {}
    prompt = row.get("prompt")
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    kwargs.update(raw_prompt=messages, extra_info=extra_info, index=extra_info.get("index", 0),
                  tools_kwargs=_tools_kwargs(row), interaction_kwargs=extra_info.get("interaction_kwargs") or {})
    name = kwargs.pop("agent_name", None)
    return (None if name is None else str(name)), kwargs


def _import_loop(target: str, where: str, search: list[Path], key: str) -> type:
    try:
        return import_class(target, where, search, LOOP_CONFIG_SHAPE, key)
    except ToolDefinitionError as error:  # the same finding and errors as verl's tool classes, named as a loop's
        raise VerlLoopError(str(error)) from error


@dataclass
class LoopEntry:
    name: str
    target: str  # pkg.module.Class, module:Class or path/file.py:Class
    kwargs: dict[str, Any] = field(default_factory=dict)  # the YAML entry's constructor arguments
    cls: type | None = None


class VerlLoops:
    """The loops a run can pick by ``agent_name``: ``spec`` is one class (``module:Class``,
    ``path/file.py:Class``, ``pkg.module.Class``) or verl's agent loop config YAML (``agent_loop_config_path``);
    loops registered with verl's ``@register`` in the modules imported count too. ``default``: the name rows
    without ``agent_name`` run (verl's ``default_agent_loop``); None with a class: that class."""

    def __init__(self, spec: str, default: str | None = None):
        self.spec, self.entries, self.search = spec, {}, [Path.cwd()]
        self.default = default
        if spec.endswith((".yaml", ".yml")):
            self._read_yaml(Path(spec))
        else:
            cls = _import_loop(spec, f"rollout.agent.verl_loop={spec}", self.search, "class")
            self._check_loop(cls, f"rollout.agent.verl_loop={spec}")
            names = [n for n, t in self._registered().items() if t == f"{cls.__module__}.{cls.__qualname__}"]
            for name in names or [cls.__name__]:
                self.entries[name] = LoopEntry(name, spec, {}, cls)
            self.default = default or (names or [cls.__name__])[0]

    def _read_yaml(self, path: Path) -> None:
        if not path.is_file():
            raise VerlLoopError(f"rollout.agent.verl_loop={self.spec}: no such file")
        try:
            document = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise VerlLoopError(f"verl agent loop config {path} is not valid YAML: {error}") from error
        if not isinstance(document, list) or not document:
            raise VerlLoopError(f"verl agent loop config {path} is not a list of loops; verl's shape is\n"
                                f"{LOOP_CONFIG_SHAPE}")
        self.search.append(path.resolve().parent)
        for i, entry in enumerate(document):
            where = f"verl agent loop config {path}, entry {i}"
            if not isinstance(entry, dict) or not entry.get("name") or not entry.get("_target_"):
                raise VerlLoopError(f"{where} needs a name and a _target_; verl's shape is\n{LOOP_CONFIG_SHAPE}")
            kwargs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
            self.entries[str(entry["name"])] = LoopEntry(str(entry["name"]), str(entry["_target_"]), kwargs)

    @staticmethod
    def _registered() -> dict[str, str]:
        """verl's ``@register`` registry, name -> ``pkg.module.Class``, where a loaded module holds one."""
        registry = getattr(sys.modules.get(VERL_REGISTRY_MODULE), "_agent_loop_registry", None) or {}
        return {name: str(entry.get("_target_")) for name, entry in registry.items() if isinstance(entry, dict)}

    @staticmethod
    def _check_loop(loop: type, where: str) -> None:
        if not inspect.iscoroutinefunction(getattr(loop, "run", None)):
            raise VerlLoopError(f"{where}: {loop.__name__} has no async run(self, sampling_params, **kwargs); a verl "
                                "agent loop subclasses verl's AgentLoopBase")

    def names(self) -> list[str]:
        return sorted({*self.entries, *self._registered()})

    def resolve(self, agent_name: str | None) -> LoopEntry:
        """The loop a row runs, its class imported at first use (as verl's hydra instantiates ``_target_``)."""
        name = agent_name if agent_name is not None else self.default
        if name is None:
            raise VerlLoopError(f"a row has no agent_name and rollout.agent.verl_default_loop is not set; set it to "
                                f"one of {', '.join(self.names())} (verl's agent.default_agent_loop), or give the "
                                "rows an agent_name column")
        entry = self.entries.get(name)
        if entry is None and name in self._registered():
            entry = self.entries[name] = LoopEntry(name, self._registered()[name])
        if entry is None:
            raise VerlLoopError(
                f"agent_name {name!r} names no verl agent loop here (known: {', '.join(self.names()) or 'none'}); "
                f"register the class with verl's @register({name!r}) in the module rollout.agent.verl_loop names, "
                f"or list it in an agent loop config YAML:\n{LOOP_CONFIG_SHAPE.replace('my_agent', name)}")
        if entry.cls is None:
            where = f"verl agent loop {name!r} (rollout.agent.verl_loop={self.spec})"
            entry.cls = _import_loop(entry.target, where, self.search, "_target_")
            self._check_loop(entry.cls, where)
        return entry


class _ConfigWrap:
    """verl's ``DictConfigWrap``: the loop reads ``.config``."""

    def __init__(self, config: Any):
        self.config = config


class _ToolListWrap:
    """verl 0.9.1's ``ToolListWrap``: the tools verl's worker loads once and hands every loop (``tools.tools``)."""

    def __init__(self, tools: list[Any]):
        self.tools = tools


def _config_object(tree: dict) -> Any:
    try:
        from omegaconf import OmegaConf  # type: ignore[import-not-found]
    except ImportError:
        return AttributeDict(tree)
    return OmegaConf.create(tree)


def verl_trainer_config(cfg: Any, limits: AgentLimits) -> dict[str, Any]:
    """The part of verl's trainer config an agent loop reads, from scalerl's keys (verl's defaults where scalerl
    has no counterpart: max_tool_response_length 256, tool_response_truncate_side middle). ``response_length``
    is the trajectory's budget less the longest prompt, as verl's prompt_length + response_length."""
    r, a = cfg.rollout, cfg.rollout.agent
    response_length = max(limits.max_total_tokens - cfg.data.max_prompt_length, 1)
    sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k or -1}
    rollout = {
        "name": r.engine, "n": r.n, **sampling, "prompt_length": cfg.data.max_prompt_length,
        "response_length": response_length, "calculate_log_probs": True, "full_determinism": False,
        "val_kwargs": {"temperature": r.val_temperature, "top_p": r.top_p, "top_k": r.top_k or -1, "n": 1,
                       "do_sample": r.val_temperature > 0},
        "multi_turn": {"enable": True, "max_assistant_turns": limits.max_turns, "max_user_turns": None,
                       "max_parallel_calls": a.max_tool_calls_per_turn, "max_tool_response_length": 256,
                       "tool_response_truncate_side": "middle", "tool_config_path": a.tool_config,
                       "function_tool_path": a.function_tool_path,
                       "interaction_config_path": a.interaction_config, "use_inference_chat_template": False,
                       "tokenization_sanity_check_mode": "disable", "format": a.tool_parser,
                       "num_repeat_rollouts": None},
        "agent": {"num_workers": 1, "default_agent_loop": a.verl_default_loop,
                  "agent_loop_config_path": a.verl_loop if str(a.verl_loop).endswith((".yaml", ".yml")) else None},
        "trace": {"backend": None, "token2text": False, "max_samples_per_step_per_worker": None},
    }
    return {
        "actor_rollout_ref": {"model": {"path": cfg.model.path, "custom_chat_template": None}, "rollout": rollout},
        "data": {"max_prompt_length": cfg.data.max_prompt_length, "max_response_length": response_length,
                 "prompt_key": cfg.data.prompt_key, "tool_config_path": a.tool_config, "return_raw_chat": True,
                 "apply_chat_template_kwargs": {}},
        "trainer": {"project_name": "scalerl", "experiment_name": Path(str(cfg.trainer.output_dir)).name},
    }


class VerlLoopEnvironment:
    """One episode of a verl agent loop, as a token-level environment: the row's loop is built (verl's
    arguments), run with the step's sampling parameters as verl passes them, and its output mapped to the
    segments the engine sampled (`episode_from_output`)."""

    def __init__(self, loops: VerlLoops, config: Any, tokenizer: HFStyleTokenizer, sampling: dict[str, Any],
                 response_length: int, tools: list[Any], hf_model_type: str | None = None):
        self.loops, self.config, self.tokenizer, self.tools = loops, config, tokenizer, tools
        self.sampling, self.response_length, self.hf_model_type = sampling, response_length, hf_model_type

    async def run(self, generate: Callable[..., Any], row: dict) -> TokenEpisode:
        agent_name, kwargs = verl_run_kwargs(row)
        entry = self.loops.resolve(agent_name)
        name = f"{entry.cls.__name__} (agent_name {entry.name!r})"
        server = VerlServerManager(generate, self.response_length, self.sampling, name,
                                   tuple(getattr(self.tokenizer, "stop_token_ids", ())))
        # verl's arguments, both releases' spellings (v0.9: dataset_config; v0.9.1: data_config, hf_model_type and
        # the tools loaded once); each where the constructor takes it (all where it has **kwargs, as verl's do).
        arguments = {"trainer_config": _ConfigWrap(self.config), "server_manager": server, "tokenizer": self.tokenizer,
                     "processor": None, "dataset_cls": None, "data_config": _ConfigWrap(self.config.data),
                     "dataset_config": _ConfigWrap(self.config.data), "hf_model_type": self.hf_model_type,
                     "tools": _ToolListWrap(self.tools), **entry.kwargs}
        try:
            loop = entry.cls(**_accepted(entry.cls.__init__, arguments))
        except Exception as error:
            raise VerlLoopError(f"verl agent loop {name}: building it raised {type(error).__name__}: {error}") \
                from error
        # verl's sampling parameters (its AgentLoopWorker's dict): the step's own, so each turn samples as the
        # single-turn rollout does; log-probs are always kept.
        sampling_params = {**self.sampling, "repetition_penalty": 1.0, "logprobs": True}
        output = await loop.run(sampling_params, **kwargs)
        return episode_from_output(name, output, server.calls)


def verl_loop_factory(cfg: Any, tokenizer: Any, limits: AgentLimits) -> Callable[[], VerlLoopEnvironment]:
    """A maker of one `VerlLoopEnvironment` per episode, from ``rollout.agent.verl_loop`` (the loops found now, so
    a spec that names nothing fails at start-up)."""
    a = cfg.rollout.agent
    loops = VerlLoops(a.verl_loop, a.verl_default_loop)
    tree = verl_trainer_config(cfg, limits)
    config = _config_object(tree)
    view = HFStyleTokenizer(tokenizer)
    r = cfg.rollout
    sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k or -1}
    response_length = tree["actor_rollout_ref"]["rollout"]["response_length"]
    # verl's tools from rollout.agent.tool_config and function_tool_path, built once as verl 0.9.1's worker builds
    # them (load_all_tools; loops of earlier releases read multi_turn.tool_config_path and build their own)
    configured = tools_from_verl_config(a.tool_config) if a.tool_config else []
    tools = [t.base_tool for t in configured]
    if a.function_tool_path:
        function_tools = load_function_tools(a.function_tool_path)
        check_tool_names({f"rollout.agent.tool_config={a.tool_config}": configured,
                          f"rollout.agent.function_tool_path={a.function_tool_path}": function_tools})
        tools += function_tools
    return lambda: VerlLoopEnvironment(loops, config, view, sampling, response_length, tools,
                                       _hf_model_type(cfg.model.path))


def _hf_model_type(path: str | None) -> str | None:
    """The model directory's ``config.json`` ``model_type`` (verl 0.9.1 picks its token-merging rules by it)."""
    config = Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    model_type = json.loads(config.read_text()).get("model_type")
    return model_type if isinstance(model_type, str) else None
