"""Rollout engines: the interface, the built-in KV-cache engine, and the optional vLLM adapter."""

from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams

__all__ = ["BuiltinEngine", "GenerationOutput", "RolloutEngine", "SamplingParams"]
