"""The parts of verl (v0.9.1) an agent loop and its tools import, transcribed from its repository
(verl/experimental/agent_loop/agent_loop.py, tool_parser.py, verl/tools/base_tool.py, schemas.py,
utils/tool_registry.py, verl/utils/chat_template.py) for tests where verl is not installed: verl itself needs
Ray, tensordict, hydra and more to import. Only what a loop touches is kept: the processor (images), tracing,
MCP tools and the Ray worker are left out. `install(directory)` writes it as a ``verl`` package there."""

from __future__ import annotations

from pathlib import Path

FILES = {
    "verl/__init__.py": "",
    "verl/experimental/__init__.py": "",
    "verl/experimental/agent_loop/__init__.py": (
        "from .agent_loop import AgentLoopBase, AgentLoopOutput, register\n"),
    "verl/experimental/agent_loop/agent_loop.py": '''
import asyncio
from abc import ABC, abstractmethod
from typing import Any, Optional

from pydantic import BaseModel

from verl.utils.chat_template import initialize_system_prompt


class AgentLoopMetrics(BaseModel):
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    multi_modal_data: Optional[dict[str, Any]] = None
    reward_score: Optional[float] = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}


class DictConfigWrap:
    def __init__(self, config):
        self.config = config


class AgentLoopBase(ABC):
    def __init__(self, trainer_config, server_manager, tokenizer, processor, dataset_cls, dataset_config, **kwargs):
        self.config = trainer_config.config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.dataset_config = dataset_config.config
        self.apply_chat_template_kwargs = self.dataset_config.get("apply_chat_template_kwargs", {})
        self.system_prompt = initialize_system_prompt(self.tokenizer, **self.apply_chat_template_kwargs)
        self.loop = asyncio.get_event_loop()

    async def apply_chat_template(self, messages, tools=None, images=None, videos=None, remove_system_prompt=False):
        prompt_ids = await self.loop.run_in_executor(None, lambda: self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **self.apply_chat_template_kwargs))
        if remove_system_prompt:
            prompt_ids = prompt_ids[len(self.system_prompt):]
        return prompt_ids

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        raise NotImplementedError


_agent_loop_registry: dict[str, dict] = {}


def register(agent_name: str):
    def decorator(subclass):
        fqdn = f"{subclass.__module__}.{subclass.__qualname__}"
        _agent_loop_registry[agent_name] = {"_target_": fqdn}
        return subclass

    return decorator
''',
    "verl/experimental/agent_loop/tool_parser.py": '''
import asyncio
import json
import re

from pydantic import BaseModel


class FunctionCall(BaseModel):
    arguments: str
    name: str


class ToolParser:
    _registry = {}

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def get_tool_parser(cls, name, tokenizer):
        if name not in cls._registry:
            raise ValueError(f"Unknown tool parser: {name}")
        return cls._registry[name](tokenizer)

    @classmethod
    def register(cls, name):
        def decorator(subclass):
            cls._registry[name] = subclass
            return subclass

        return decorator


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    async def extract_tool_calls(self, responses_ids):
        text = await asyncio.get_event_loop().run_in_executor(None, self.tokenizer.decode, responses_ids)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            return text, []
        calls = []
        for match in self.tool_call_regex.findall(text):
            try:
                call = json.loads(match)
                calls.append(FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"])))
            except Exception:
                pass
        return self.tool_call_regex.sub("", text), calls
''',
    "verl/utils/__init__.py": "",
    "verl/utils/chat_template.py": '''
def initialize_system_prompt(tokenizer, **apply_chat_template_kwargs):
    token1 = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False,
                                           tokenize=True)
    token2 = tokenizer.apply_chat_template([{"role": "user", "content": ""}] * 2, add_generation_prompt=False,
                                           tokenize=True)
    return token1[: -(len(token2) - len(token1))]
''',
    "verl/tools/__init__.py": "",
    "verl/tools/schemas.py": '''
from typing import Any, Optional

from pydantic import BaseModel


class OpenAIFunctionPropertySchema(BaseModel):
    type: str
    description: Optional[str] = None
    enum: Optional[list[str]] = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: str
    function: OpenAIFunctionSchema


class ToolResponse(BaseModel):
    text: Optional[str] = None
    image: Optional[list[Any]] = None
    video: Optional[list[Any]] = None
''',
    "verl/tools/base_tool.py": '''
from uuid import uuid4

from .schemas import ToolResponse


class BaseTool:
    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, **kwargs):
        return (str(uuid4()) if instance_id is None else instance_id), ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass
''',
    "verl/tools/utils/__init__.py": "",
    "verl/tools/utils/tool_registry.py": '''
import importlib

import yaml

from verl.tools.schemas import OpenAIFunctionToolSchema


def get_tool_class(cls_name):
    module_name, class_name = cls_name.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)


def initialize_tools_from_config(tools_config_file):
    with open(tools_config_file) as f:
        tools_config = yaml.safe_load(f)  # verl: OmegaConf.load
    tool_list = []
    for tool_config in tools_config["tools"]:
        tool_cls = get_tool_class(tool_config["class_name"])
        schema = tool_config.get("tool_schema")
        tool_schema = None if schema is None else OpenAIFunctionToolSchema.model_validate(schema)
        tool_list.append(tool_cls(config=tool_config["config"], tool_schema=tool_schema))
    return tool_list
''',
}


def install(directory: Path) -> Path:
    """Writes the stand-in ``verl`` package under ``directory`` (put it on ``sys.path``)."""
    for relative, text in FILES.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip("\n"))
    return directory
