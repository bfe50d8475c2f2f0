"""Rollout: the engine interface, the built-in KV-cache engine and its continuous batching
(`continuous_engine`: a request queue, freed slots refilled), the optional vLLM adapter, the rollout
batch (prompts + responses + everything the update computes on them), where a step's rollouts come from
(`sources`: colocated or standalone workers, `worker` and its `worker_protocol`), and weight sync's two
ends on this side: the strategies the sources hold (`weight_sync`: shared weights, replica refresh, load
into an engine, push to workers) and how an engine with its own weights takes the pushes (`weight_loading`)."""

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.continuous_engine import ContinuousEngine, GenerationRequest, RequestOutput
from scalerl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams
from scalerl.rollout.weight_loading import (
           EngineWeightStore,
           WeightLoadingEngine,
           engine_weight_receiver,
)

__all__ = ["BuiltinEngine", "ContinuousEngine", "EngineWeightStore", "GenerationOutput", "GenerationRequest",
           "RequestOutput", "RolloutBatch", "RolloutEngine", "SamplingParams", "WeightLoadingEngine",
           "engine_weight_receiver"]
