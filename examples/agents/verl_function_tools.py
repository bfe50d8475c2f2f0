"""verl function tools (``actor_rollout_ref.rollout.multi_turn.function_tool_path``), as a verl user writes them:
plain functions under verl's ``@function_tool``, the schema read from the type hints and the Google-style
docstring. scalerl loads the file unchanged, verl installed or not (where it is not, scalerl stands in for the
decorator's module while the file runs):

    scalerl train rollout.agent.env=tools rollout.agent.function_tool_path=examples/agents/verl_function_tools.py ...

Each call is ``fn(**arguments)`` (stateless); a dict comes back to the model as JSON, a string as it is. See
docs/agents.md#verl-function-tools.
"""

from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> dict:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return {"sum": a + b}


@function_tool("multiply")
def times(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)
