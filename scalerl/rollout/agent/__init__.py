"""The agent loop: environments, tools, tool-call parsing, the sandbox. A multi-turn rollout producer: the
model's turn is parsed for tool calls (`tool_calls`: `get_parser`, `HermesToolCallParser`), each call is
checked and run under a timeout (`tools`: `Tool`, `tool_from_function`, `call_tool`), and the results go
back to the model as the next turn's context; the trainer only ever sees the resulting trajectories.
Model-written code runs in `sandbox` (`ProcessSandbox`, or any `Sandbox` from `sandbox_from_spec`) under
`SandboxLimits`."""

from scalerl.rollout.agent.sandbox import (
    ProcessSandbox,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    sandbox_from_spec,
)
from scalerl.rollout.agent.tool_calls import (
    PARSERS,
    HermesToolCallParser,
    ParsedTurn,
    ToolCall,
    ToolCallParser,
    get_parser,
)
from scalerl.rollout.agent.tools import (
    Tool,
    ToolDefinitionError,
    ToolResult,
    call_tool,
    tool_from_function,
    tools_from_module,
    validate_arguments,
)

__all__ = ["PARSERS", "HermesToolCallParser", "ParsedTurn", "ProcessSandbox", "Sandbox", "SandboxError",
           "SandboxLimits", "SandboxResult", "Tool", "ToolCall", "ToolCallParser", "ToolDefinitionError", "ToolResult",
           "call_tool", "get_parser", "sandbox_from_spec", "tool_from_function", "tools_from_module", "validate_arguments"]
