"""A verl tool, shaped as verl's own Gsm8kTool (verl/tools/gsm8k_tool.py): one instance per trajectory, created
with the row's ground truth, scored by calc_reward, released at the end. A verl user's tool subclasses
verl.tools.base_tool.BaseTool; this one is written to that interface without importing verl, so it also runs
where verl is not installed. Named in verl_tool_config.yml, which scalerl reads as verl does.
"""

from dataclasses import dataclass
from uuid import uuid4


@dataclass
class ToolResponse:  # verl.tools.schemas.ToolResponse's fields
    text: str | None = None
    image: list | None = None
    video: list | None = None


class AnswerTool:
    def __init__(self, config: dict, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self._instance_dict = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:  # verl's agent loop passes create_kwargs=..., its SGLang rollout **create_kwargs
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instance_dict[instance_id] = {"answer": None, "ground_truth": ground_truth}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        answer = str(parameters.get("answer", "")).strip()
        self._instance_dict[instance_id]["answer"] = answer
        return ToolResponse(text=f"received {answer}"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return float(state["ground_truth"] is not None and state["answer"] == str(state["ground_truth"]).strip())

    async def release(self, instance_id, **kwargs):
        self._instance_dict.pop(instance_id, None)
