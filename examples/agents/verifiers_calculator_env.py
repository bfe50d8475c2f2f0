"""A verifiers-style tool environment, trained with ``rollout.agent.env=verifiers``::

    scalerl train rollout.agent.env=verifiers \\
        rollout.agent.verifiers_env=examples/agents/verifiers_calculator_env.py:load_environment

scalerl calls what a verifiers environment publishes (the classic ``verifiers.envs`` interface of
``SingleTurnEnv`` / ``MultiTurnEnv`` / ``ToolEnv``): ``completion, state = await env.rollout(client, model,
prompt, answer=..., task=..., info=..., sampling_args=...)`` with an ``openai.AsyncOpenAI`` client of the
episode's session on the in-run endpoint, then ``await env.rubric.score_rollout(prompt, completion, answer,
state, ...)``. Your ``load_environment`` returning a ``vf.ToolEnv(...)`` is named the same way; this file
carries the loop itself so that it runs without the package (whose current release, 0.4, is the
``verifiers.v1`` stack: see docs/agents.md for what that means here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and parentheses."""
    if not set(expression) <= set("0123456789+-*() "):
        return "error: only integers, + - * and parentheses"
    return str(eval(expression, {"__builtins__": {}}))  # the characters are checked above: no names, no calls


TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": calculate.__doc__,
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@dataclass
class RolloutScore:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


class CorrectAnswerRubric:
    async def score_rollout(self, prompt, completion, answer, state, task="default", info=None, **kwargs):
        last = next((m["content"] or "" for m in reversed(completion) if m["role"] == "assistant"), "")
        used_tool = any(m["role"] == "tool" for m in completion)
        reward = float(bool(answer) and answer in last) + 0.1 * used_tool
        return RolloutScore(reward, {"correct": float(bool(answer) and answer in last), "used_tool": float(used_tool)})


class CalculatorEnv:
    """verifiers' ToolEnv loop: the model calls ``calculate`` until it answers without a call."""

    def __init__(self, max_turns: int = 4):
        self.max_turns, self.oai_tools, self.rubric = max_turns, TOOLS, CorrectAnswerRubric()
        self.system_prompt = "Use the calculate tool for arithmetic, then answer with the number."

    async def rollout(self, client, model, prompt, completion=None, answer="", state=None, task="default",
                      info=None, sampling_args=None, **kwargs):
        state = {"responses": [], "turn": 0, "answer": answer}
        messages, completion = list(prompt), []
        while state["turn"] < self.max_turns:
            response = await client.chat.completions.create(model=model, messages=messages, tools=self.oai_tools,
                                                            **(sampling_args or {}))
            state["responses"].append(response)
            message = response.choices[0].message
            assistant = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                assistant["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            messages.append(assistant)
            completion.append(assistant)
            state["turn"] += 1
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    result = calculate(**json.loads(call.function.arguments))
                except Exception as error:  # noqa: BLE001 - the model's mistake goes back to it
                    result = f"error: {error}"
                tool = {"role": "tool", "tool_call_id": call.id, "content": result}
                messages.append(tool)
                completion.append(tool)
        return completion, state


def load_environment() -> CalculatorEnv:
    return CalculatorEnv()
