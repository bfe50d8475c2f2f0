"""Rollout: the engine interface, the built-in KV-cache engine, the optional vLLM adapter, and the rollout
batch (prompts + responses + everything the update computes on them)."""

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams

__all__ = ["BuiltinEngine", "GenerationOutput", "RolloutBatch", "RolloutEngine", "SamplingParams"]
