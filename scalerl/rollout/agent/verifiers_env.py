"""A `verifiers` environment's rollout, run as it is, as a scalerl episode (``rollout.agent.env=verifiers``).

The environment is built by the user's ``load_environment`` (``rollout.agent.verifiers_env``:
``module:load_environment`` or ``path/file.py:load_environment``, called with the JSON object
``rollout.agent.verifiers_env_args`` as keyword arguments) and played with
the interface verifiers' environments publish (`SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`): per episode
``completion, state = await env.rollout(client, model, prompt, answer=..., task=..., info=...,
sampling_args=...)`` on an ``openai.AsyncOpenAI`` client of the episode's session on the in-run
`RolloutEndpoint`, then ``await env.rubric.score_rollout(prompt, completion, answer, state, task=...,
info=...)``, whose ``reward`` is the episode's. The client gets the sampling arguments prime-rl sends
(``logprobs``, ``extra_body.return_tokens_as_token_ids``), which the endpoint answers as vLLM does; the
trajectory itself comes from the endpoint's record of the calls (the ids the engine sampled), not from
the environment's parsing of them.

The row's ``prompt`` (a string: one user message after the environment's ``system_prompt``, if it has one;
or a list of messages), ``answer`` (else ``ground_truth``), ``task`` and ``info`` are what the rollout gets.

Not covered (docs/agents.md names it): verifiers' newer state-based rollout (``rollout(input, client,
model, sampling_args)``) and the ``verifiers.v1`` stack (an ``Env`` running harness programs through its
interception server); the token-in route their train client calls, ``POST /inference/v1/generate``, is
served by the endpoint.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from scalerl.core.errors import UserError
from scalerl.rollout.agent.endpoint import RolloutEndpoint


def load_function(spec: str, key: str) -> Any:
    """What ``spec`` names: ``package.module:name`` or ``path/to/file.py:name`` (``key``: the config key, for errors)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UserError(f"{key}={spec!r}: give it as module:load_environment or path/to/file.py:load_environment")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UserError(f"{key}={spec!r}: file {where} not found")
            module_name = f"scalerl_verifiers_env_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as error:  # the user's module raised on import: say which and why
        raise UserError(f"{key}={spec!r}: importing {where} failed: {type(error).__name__}: {error}") from error
    if not hasattr(module, name):
        raise UserError(f"{key}={spec!r}: {where} has no {name}")
    return getattr(module, name)


def load_verifiers_env(spec: str, args: str | None = None) -> Any:
    """The environment ``spec``'s function builds (with ``args``, a JSON object of keyword arguments), checked
    for the interface this module calls."""
    make = load_function(spec, "rollout.agent.verifiers_env")
    if not callable(make):
        raise UserError(f"rollout.agent.verifiers_env={spec!r} is not a function (give the environment's "
                        "load_environment)")
    try:
        kwargs = json.loads(args) if args else {}
    except json.JSONDecodeError as error:
        raise UserError(f"rollout.agent.verifiers_env_args={args!r} is not JSON: {error}") from None
    if not isinstance(kwargs, dict):
        raise UserError(f"rollout.agent.verifiers_env_args={args!r}: give a JSON object of keyword arguments")
    try:
        env = make(**kwargs)
    except Exception as error:
        raise UserError(f"rollout.agent.verifiers_env={spec!r} raised: {type(error).__name__}: {error}") from error
    rollout = getattr(env, "rollout", None)
    score = getattr(getattr(env, "rubric", None), "score_rollout", None)
    if not (callable(rollout) and callable(score)):
        raise UserError(f"rollout.agent.verifiers_env={spec!r} built a {type(env).__name__}, which has no "
                        f"{'rollout(client, model, prompt, ...)' if not callable(rollout) else 'rubric.score_rollout'}: "
                        "a verifiers environment (SingleTurnEnv, MultiTurnEnv, ToolEnv) has both")
    return env


def _accepted(fn: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """``wanted`` less the keywords ``fn`` takes neither by name nor through ``**kwargs``."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return wanted
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return wanted
    return {k: v for k, v in wanted.items() if k in parameters}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class VerifiersRunner:
    """Plays a session with the environment ``spec`` loads (`load_verifiers_env`)."""

    def __init__(self, spec: str, args: str | None = None, sampling_args: dict[str, Any] | None = None):
        self.spec, self.env = spec, load_verifiers_env(spec, args)
        self.sampling_args = sampling_args

    def describe(self) -> str:
        return f"rollout.agent.verifiers_env {self.spec!r} ({type(self.env).__name__})"

    def prompt(self, row: dict) -> list[dict]:
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            return [dict(m) for m in prompt]
        if not isinstance(prompt, str):
            raise UserError(f"{self.describe()}: a row's prompt is a string or a list of messages, got "
                            f"{type(prompt).__name__}")
        system = getattr(self.env, "system_prompt", None)
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]

    async def episode(self, endpoint: RolloutEndpoint, session: str, row: dict) -> None:
        from openai import AsyncOpenAI

        prompt = self.prompt(row)
        answer = row.get("answer", row.get("ground_truth", ""))
        answer = "" if answer is None else str(answer)
        task, info = row.get("task", "default"), row.get("info") or {}
        sampling = endpoint.sampling  # what prime-rl asks a vLLM server for; the endpoint decides the sampling
        sampling_args = self.sampling_args or {
            "temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": endpoint.max_new_tokens,
            "logprobs": True, "extra_body": {"return_tokens_as_token_ids": True, "top_k": sampling.top_k or -1}}
        client = AsyncOpenAI(base_url=endpoint.base_url(session), api_key=endpoint.token, max_retries=0,
                             timeout=endpoint.request_timeout_s)
        try:
            completion, state = await _maybe_await(self.env.rollout(client, endpoint.model_name, prompt, **_accepted(
                self.env.rollout, {"answer": answer, "task": task, "info": info, "sampling_args": sampling_args})))
            score_rollout = self.env.rubric.score_rollout
            score = await _maybe_await(score_rollout(prompt, completion, answer, state, **_accepted(
                score_rollout, {"task": task, "info": info})))
        except UserError:
            raise
        except Exception as error:  # the user's environment or rubric failed: say whose, where and why
            raise UserError(f"{self.describe()} raised in session {session}: {type(error).__name__}: {error}") \
                from error
        finally:
            await client.close()
        reward = getattr(score, "reward", score)
        try:
            endpoint.set_reward(session, float(reward))
        except (TypeError, ValueError):
            raise UserError(f"{self.describe()}: rubric.score_rollout gave {score!r}; a RolloutScore (or a number) "
                            "with a finite reward") from None


__all__ = ["VerifiersRunner", "load_function", "load_verifiers_env"]
