"""The parts of verl (v0.9.1) an agent loop and its tools import, transcribed from its repository
(verl/experimental/agent_loop/agent_loop.py, tool_parser.py, verl/tools/base_tool.py, schemas.py,
function_tool.py, utils/tool_registry.py, verl/utils/chat_template.py) for tests where verl is not installed: verl itself needs
Ray, tensordict, hydra and more to import. Only what a loop touches is kept: the processor (images), tracing,
MCP tools and the Ray worker are left out. `install(directory)` writes it as a ``verl`` package there (the
``stand_in_verl`` fixture of conftest.py puts it on the path for a test). Its ``BaseTool`` and ``ToolResponse`` are
what the tests' verl-format tools subclass and return, in test_adapters.py and test_verl_loop.py alike."""

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
    "verl/tools/function_tool.py": '''
import asyncio
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from transformers.utils import get_json_schema

from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

FUNCTION_TOOL_REGISTRY = {}
_LOADED_FUNCTION_TOOL_PATHS = {}


@dataclass
class FunctionTool:
    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters):
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)


def function_tool(name=None, *, schema=None):
    def _make_decorator(tool_name_override):
        def decorator(fn):
            tool_name = tool_name_override or fn.__name__
            if isinstance(schema, OpenAIFunctionToolSchema):
                built_schema = schema
            elif isinstance(schema, dict):
                built_schema = OpenAIFunctionToolSchema.model_validate(schema)
            else:
                built_schema = _build_schema_from_fn(fn, tool_name)
            entry = FunctionTool(name=tool_name, fn=fn, tool_schema=built_schema,
                                 is_async=inspect.iscoroutinefunction(fn))
            existing = FUNCTION_TOOL_REGISTRY.get(tool_name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(f"Function tool '{tool_name}' is already registered")
            FUNCTION_TOOL_REGISTRY[tool_name] = entry
            return fn

        return decorator

    if callable(name) and schema is None:
        return _make_decorator(None)(name)
    return _make_decorator(name)


def load_function_tools_from_path(path):
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"function_tool_path does not exist: {path}")
    if abs_path in _LOADED_FUNCTION_TOOL_PATHS:
        return _LOADED_FUNCTION_TOOL_PATHS[abs_path]
    before = set(FUNCTION_TOOL_REGISTRY)
    module_name = "_verl_function_tools_" + abs_path.replace(os.sep, "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, abs_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    tools = [FUNCTION_TOOL_REGISTRY[name] for name in sorted(set(FUNCTION_TOOL_REGISTRY) - before)]
    _LOADED_FUNCTION_TOOL_PATHS[abs_path] = tools
    return tools


def _build_schema_from_fn(fn, tool_name):
    sig = inspect.signature(fn)
    variadic = [n for n, p in sig.parameters.items()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool '{tool_name}' declares variadic parameter(s) {variadic}")
    raw = get_json_schema(fn)
    raw["function"]["name"] = tool_name
    return OpenAIFunctionToolSchema.model_validate(raw)


def normalize_function_tool_return(ret):
    if isinstance(ret, ToolResponse):
        return ret, 0.0, {}
    if isinstance(ret, str):
        return ToolResponse(text=ret), 0.0, {}
    if isinstance(ret, dict):
        return ToolResponse(text=json.dumps(ret, ensure_ascii=False)), 0.0, {}
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(ret)})")
        response = ret[0] if isinstance(ret[0], ToolResponse) else ToolResponse(
            text=ret[0] if isinstance(ret[0], str) else json.dumps(ret[0]) if isinstance(ret[0], dict) else str(ret[0]))
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return response, reward, metrics
    return ToolResponse(text=str(ret)), 0.0, {}
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
