"""Small classes written to the published interface of `verifiers`' environments (the classic
``verifiers.envs``: ``Environment``, ``MultiTurnEnv``, ``ToolEnv``, ``Rubric``; not the package: its current
release is the ``verifiers.v1`` stack, which has none of them): the rollout loop as verifiers runs it, on an
``AsyncOpenAI`` client (``chat.completions.create(model, messages, tools=oai_tools, **sampling_args)``, the
assistant message appended as a dict with its tool calls, ``env_response`` messages after it), and the
rubric's ``score_rollout(prompt, completion, answer, state, task, info) -> RolloutScore``. Each response is
kept in ``state["responses"]`` as verifiers keeps it (prime-rl reads token ids and log-probs from them)."""

from __future__ import annotations

import inspect
import json
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RolloutScore:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


class Rubric:
    def __init__(self, funcs: list, weights: list[float] | None = None):
        self.funcs, self.weights = funcs, weights or [1.0] * len(funcs)

    async def score_rollout(self, prompt, completion, answer, state, task="default", info=None, **kwargs):
        metrics = {}
        for fn in self.funcs:
            value = fn(prompt=prompt, completion=completion, answer=answer, state=state, task=task, info=info)
            metrics[fn.__name__] = float(await value if inspect.isawaitable(value) else value)
        return RolloutScore(sum(w * m for w, m in zip(self.weights, metrics.values())), metrics)


class Environment:
    def __init__(self, system_prompt: str | None = None, rubric: Rubric | None = None, oai_tools=None, **kwargs):
        self.system_prompt, self.rubric, self.oai_tools = system_prompt, rubric or Rubric([]), oai_tools

    async def get_model_response(self, client, model, prompt, oai_tools=None, sampling_args=None):
        args = dict(sampling_args or {})
        if oai_tools:
            args["tools"] = oai_tools
        return await client.chat.completions.create(model=model, messages=prompt, **args)


class MultiTurnEnv(Environment):
    def __init__(self, max_turns: int = 10, **kwargs):
        super().__init__(**kwargs)
        self.max_turns = max_turns

    async def is_completed(self, messages, state, **kwargs) -> bool:
        raise NotImplementedError

    async def env_response(self, messages, state, **kwargs) -> tuple[list[dict], dict]:
        raise NotImplementedError

    async def rollout(self, client, model, prompt, completion=None, answer="", state=None, task="default",
                      info=None, sampling_args=None, **kwargs):
        state = {"prompt": prompt, "completion": [], "answer": answer, "task": task, "info": info or {},
                 "responses": [], "turn": 0}
        messages, completion = deepcopy(prompt), []
        while True:
            response = await self.get_model_response(client, model, messages, self.oai_tools, sampling_args)
            state["responses"].append(response)
            message = response.choices[0].message
            assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                assistant["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            messages.append(assistant)
            completion.append(assistant)
            state["turn"] += 1
            if await self.is_completed(messages, state) or state["turn"] >= self.max_turns:
                break
            new, state = await self.env_response(messages, state)
            messages += new
            completion += new
        state["completion"] = completion
        return completion, state


class ToolEnv(MultiTurnEnv):
    """Python functions as tools (their schema from the signature, as verifiers' ``convert_func_to_oai_tool``
    does, reduced to integer arguments here); done when the model answers without a call."""

    def __init__(self, tools: list, **kwargs):
        self.tools = {t.__name__: t for t in tools}
        schemas = [{"type": "function", "function": {
            "name": t.__name__, "description": (t.__doc__ or "").strip(),
            "parameters": {"type": "object", "properties": {p: {"type": "integer"} for p in
                                                              inspect.signature(t).parameters},
                           "required": list(inspect.signature(t).parameters)}}} for t in tools]
        super().__init__(oai_tools=schemas, **kwargs)

    async def is_completed(self, messages, state, **kwargs) -> bool:
        return not messages[-1].get("tool_calls")

    async def env_response(self, messages, state, **kwargs):
        out = []
        for call in messages[-1]["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            result = self.tools[call["function"]["name"]](**arguments)
            out.append({"role": "tool", "content": str(result), "tool_call_id": call["id"]})
        return out, state


# ---------------------------------------------------------------------------------------------- environments
class AgainEnv(MultiTurnEnv):
    """Two turns: after the first answer the user says "again"."""

    async def is_completed(self, messages, state, **kwargs) -> bool:
        return False

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}], state


def token_sum_reward(completion, state, **kwargs) -> float:
    """Differs within a group for an untrained model: the last response's token ids (prime-rl's reading of the
    ``token_id:<id>`` log-prob tokens) summed, mod 7."""
    tokens = state["responses"][-1].choices[0].logprobs.content
    return sum(int(t.token.removeprefix("token_id:")) for t in tokens) % 7 / 7


def load_environment() -> AgainEnv:
    return AgainEnv(max_turns=2, rubric=Rubric([token_sum_reward]))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def right_answer(completion, answer, **kwargs) -> float:
    return float(any(m["role"] == "tool" and m["content"] == answer for m in completion))


def load_tool_environment(max_turns: int = 3) -> ToolEnv:
    return ToolEnv(tools=[add], max_turns=max_turns, system_prompt="Use the tools.", rubric=Rubric([right_answer]))
