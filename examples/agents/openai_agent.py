"""An agent program written against the OpenAI chat API (a calculator tool loop), run as an RL episode.

Nothing in the agent knows about scalerl. Pointed at scalerl's rollout endpoint it becomes an episode whose
every call's token ids are recorded and stitched into a trajectory to train on; only two arguments change:

    before:  client = OpenAI(base_url="https://api.openai.com/v1", api_key=os.environ["OPENAI_API_KEY"])
    after:   client = OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key=token)

Against a served model (``scalerl serve-rollouts --model DIR`` prints ``url`` and ``token``)::

    python examples/agents/openai_agent.py --base-url http://127.0.0.1:PORT/sessions/episode-1/v1 --api-key TOKEN
    curl -X POST -H "Authorization: Bearer TOKEN" -d '{"reward": 1}' http://127.0.0.1:PORT/sessions/episode-1/reward
    curl -X POST -H "Authorization: Bearer TOKEN" http://127.0.0.1:PORT/sessions/episode-1/close   # trajectories

Or all in one process, the trainer's side included (the built-in tiny model, randomly initialised: it will
not call the tools, but every call is recorded the same way)::

    python examples/agents/openai_agent.py --self-hosted

Needs ``pip install openai``. See docs/agent-endpoint.md.
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]
FUNCTIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


def run_agent(client: OpenAI, question: str, model: str = "default", max_calls: int = 6,
              max_tokens: int = 256) -> str:
    """The agent: ask, run the tools the model calls, hand back their results, until it answers."""
    messages = [{"role": "system", "content": "Use the tools for arithmetic. Answer with the number."},
                {"role": "user", "content": question}]
    for _ in range(max_calls):
        response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = FUNCTIONS[call.function.name](**json.loads(call.function.arguments))
            except Exception as error:  # the model's mistake goes back to it, as any agent would do
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return ""


def self_hosted(question: str, expected: str) -> None:
    """The trainer's side too: an endpoint on the built-in tiny model, one session, the agent, a reward, the
    trajectory collected."""
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.models.tokenizer import CharTokenizer
    from scalerl.rollout.agent.endpoint import RolloutEndpoint
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams

    tokenizer = CharTokenizer()
    model = build_model(ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=1024), seed=0).eval()
    engine = BuiltinEngine(model, tokenizer.pad_token_id).continuous_engine(768, 64, max_num_seqs=4)
    with RolloutEndpoint(engine, tokenizer, sampling=SamplingParams(seed=0)) as endpoint:
        session = endpoint.open_session({"question": question, "answer": expected})
        client = OpenAI(base_url=endpoint.base_url(session), api_key=endpoint.token, max_retries=0)
        answer = run_agent(client, question, max_tokens=32)
        endpoint.set_reward(session, float(expected in answer))
        trajectories, reward = endpoint.collect(session)
    for t in trajectories:
        trained = sum(len(s.token_ids) for s in t.segments if s.generated)
        print(f"trajectory: {len(t.prompt_ids)} prompt tokens, {t.num_turns} engine turns, {trained} trained of "
              f"{len(t.response_ids)} response tokens, reward {reward}, {t.reward_inputs['info']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), help="the session's base URL")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="the endpoint's token")
    parser.add_argument("--model", default="default", help="model name sent (the endpoint serves one model)")
    parser.add_argument("--question", default="What is 12 * (3 + 4)?")
    parser.add_argument("--expected", default="84")
    parser.add_argument("--self-hosted", action="store_true", help="start an endpoint on the built-in model here")
    args = parser.parse_args()
    if args.self_hosted:
        self_hosted(args.question, args.expected)
        return
    if not args.base_url or not args.api_key:
        parser.error("--base-url and --api-key (or OPENAI_BASE_URL / OPENAI_API_KEY), or --self-hosted")
    answer = run_agent(OpenAI(base_url=args.base_url, api_key=args.api_key), args.question, args.model)
    print(json.dumps({"answer": answer, "correct": args.expected in answer}))


if __name__ == "__main__":
    main()
