"""A verl agent loop, as a verl user writes one: an ``AgentLoopBase`` subclass registered by name, its tools
handed in from the tool config (verl 0.9.1's ``tools=ToolListWrap``), each turn sampled through
``self.server_manager.generate`` and the tool answers appended as context (mask 0). scalerl runs it unchanged:

    scalerl train rollout.agent.env=verl rollout.agent.verl_loop=examples/agents/verl_agent_loop.py:AnswerAgentLoop \\
        rollout.agent.tool_config=examples/agents/verl_tool_config.yml data.format=verl data.train_files=[...]

(with verl: ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` listing it, rows with
``agent_name: answer_agent``). It imports verl, as the user's file does: verl (or a module of its shape) must be
importable. See docs/agents.md#verl-agent-loops.
"""

import json
import re
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # the Hermes format (Qwen2.5 / Qwen3)


@register("answer_agent")
class AnswerAgentLoop(AgentLoopBase):
    def __init__(self, *args, tools=None, **kwargs):
        super().__init__(*args, **kwargs)
        rollout = self.config.actor_rollout_ref.rollout
        self.max_assistant_turns = rollout.multi_turn.max_assistant_turns
        self.response_length = rollout.response_length
        self.tools = {tool.name: tool for tool in (tools.tools if tools else [])}
        self.tool_schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                             for t in self.tools.values()]
        # what the template puts before any message (a default system prompt), cut from a lone tool turn
        one = self.tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=True)
        two = self.tokenizer.apply_chat_template([{"role": "user", "content": ""}] * 2, tokenize=True)
        self.system_prefix = len(one) - (len(two) - len(one))

    async def run(self, sampling_params, **kwargs):
        tools_kwargs = kwargs.get("tools_kwargs", {})
        prompt_ids = self.tokenizer.apply_chat_template(list(kwargs["raw_prompt"]), tools=self.tool_schemas,
                                                        add_generation_prompt=True, tokenize=True)
        ids, mask, logprobs, rewards, turns = list(prompt_ids), [], [], [], 0
        request_id = uuid4().hex
        while turns < self.max_assistant_turns and len(mask) < self.response_length:
            out = await self.server_manager.generate(request_id, prompt_ids=ids, sampling_params=sampling_params)
            turns += 1
            ids, mask, logprobs = ids + out.token_ids, mask + [1] * len(out.token_ids), logprobs + out.log_probs
            calls = [json.loads(c) for c in TOOL_CALL.findall(self.tokenizer.decode(out.token_ids))]
            if not calls:
                break
            replies = []
            for call in calls:
                tool = self.tools[call["name"]]
                create_kwargs = tools_kwargs.get(call["name"], {}).get("create_kwargs", {})
                instance_id, _ = await tool.create(create_kwargs=create_kwargs)
                response, _, _ = await tool.execute(instance_id, call["arguments"])
                rewards.append(await tool.calc_reward(instance_id))
                await tool.release(instance_id)
                replies.append({"role": "tool", "content": response.text or ""})
            tool_ids = self.tokenizer.apply_chat_template(replies, add_generation_prompt=True,
                                                          tokenize=True)[self.system_prefix:]
            if len(mask) + len(tool_ids) >= self.response_length:
                break
            ids, mask, logprobs = ids + tool_ids, mask + [0] * len(tool_ids), logprobs + [0.0] * len(tool_ids)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):], response_mask=mask,
                               response_logprobs=logprobs, reward_score=max(rewards) if rewards else None,
                               num_turns=2 * turns, metrics=AgentLoopMetrics())
