"""Rollout: the engine interface, the built-in KV-cache engine, the optional vLLM adapter, the rollout
batch (prompts + responses + everything the update computes on them), and the receiving side of weight
sync (`weight_loading`: how an engine with its own weights takes the trainer's pushes)."""

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams
from scalerl.rollout.weight_loading import (
           EngineWeightStore,
           WeightLoadingEngine,
           engine_weight_receiver,
)

__all__ = ["BuiltinEngine", "EngineWeightStore", "GenerationOutput", "RolloutBatch", "RolloutEngine", "SamplingParams",
           "WeightLoadingEngine", "engine_weight_receiver"]
