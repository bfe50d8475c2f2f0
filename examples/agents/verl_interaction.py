"""A verl interaction (``BaseInteraction``, verl <= 0.7.1), shaped as verl's own Gsm8kInteraction: the row's
ground truth at the start, each answer checked, a hint until it is right. scalerl runs it as the user of its tool
environment, named in verl_interaction_config.yml and picked by the rows' ``extra_info.interaction_kwargs.name``:

    scalerl train rollout.agent.env=tools \\
        rollout.agent.interaction_config=examples/agents/verl_interaction_config.yml data.format=verl ...

Its response is the next user message; its score the episode's reward (the last turn's); ``should_terminate``
ends the episode. It imports verl's ``BaseInteraction``: where verl is not installed, or is 0.8 or later (which
dropped interactions), scalerl stands in for it while the file loads. See docs/agents.md#verl-interactions.
"""

from uuid import uuid4

from verl.interactions.base import BaseInteraction


class AnswerCheckInteraction(BaseInteraction):
    def __init__(self, config):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        self._instance_dict[instance_id]["response"] = answer
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, "Your response is correct!", score, {}
        return False, self.config.get("hint", "Your response is incorrect. Try again."), score, {}

    async def calculate_score(self, instance_id, **kwargs):
        state = self._instance_dict[instance_id]
        return float(state["response"].strip() == str(state["ground_truth"]))

    async def finalize_interaction(self, instance_id, **kwargs):
        self._instance_dict.pop(instance_id, None)
