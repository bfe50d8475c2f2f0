"""An agent program trained as it is: ``rollout.agent.env=program`` runs it once per episode inside the run.

It is an ordinary OpenAI-client program (a calculator tool loop). The trainer starts its rollout endpoint on
127.0.0.1 and runs this file once per row of each step, with the episode's session in the variables the
``openai`` client reads by itself (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), the row in ``SCALERL_ROW``, and
where to post the reward in ``SCALERL_REWARD_URL``::

    scalerl train rollout.agent.env=program rollout.agent.program=examples/agents/program_agent.py \\
        rollout.agent.episode_timeout_s=300 rollout.agent.max_concurrent_episodes=32

What changed against the program as it was written for an API (see docs/agent-endpoint.md)::

    before:  question = sys.argv[1]
             client = OpenAI(base_url="https://api.openai.com/v1", api_key=os.environ["OPENAI_API_KEY"])
             print(run_agent(client, question))
    after:   row = json.loads(os.environ["SCALERL_ROW"]); question = row["prompt"]
             client = OpenAI()                       # OPENAI_BASE_URL / OPENAI_API_KEY: the episode's session
             answer = run_agent(client, question)
             post_reward(float(row["ground_truth"] in answer))   # optional: else the run's reward function scores

Needs ``pip install openai``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculate(expression: str) -> str:
    if not set(expression) <= set("0123456789+-*() "):
        return "error: only integers, + - * and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # the characters are checked above: no names, no calls
    except Exception as error:  # noqa: BLE001 - the model's mistake goes back to it
        return f"error: {error}"


def run_agent(client: OpenAI, question: str, model: str = "default", max_calls: int = 4) -> str:
    """The agent: ask, run the tool calls, hand back their results, until the model answers."""
    messages = [{"role": "user", "content": question}]
    for _ in range(max_calls):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def post_reward(reward: float) -> None:
    """The episode's reward, to the endpoint (the trainer's session), with the same token as the client."""
    request = urllib.request.Request(os.environ["SCALERL_REWARD_URL"], data=json.dumps({"reward": reward}).encode(),
                                     headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                              "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).read()


def main() -> None:
    if "SCALERL_ROW" not in os.environ:
        sys.exit("run by the trainer (rollout.agent.env=program rollout.agent.program=" + __file__ + ")")
    row = json.loads(os.environ["SCALERL_ROW"])
    client = OpenAI(max_retries=0)
    answer = run_agent(client, row["prompt"], os.environ.get("SCALERL_MODEL", "default"))
    if row.get("ground_truth") is not None:
        post_reward(float(str(row["ground_truth"]) in answer))


if __name__ == "__main__":
    main()
