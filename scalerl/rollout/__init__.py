"""Rollout, in wings: `engines/` (the engine interface, the built-in KV-cache engine and its continuous
batching, the optional vLLM adapters, `rollout.engine=auto` decided once, how an engine with its own weights
takes the pushes), `worker/` (the standalone rollout worker, its protocol and tensor messages) and `agent/`
(multi-turn rollouts). The trainer-facing modules are here at the top: the rollout batch (`batch`: prompts +
responses + everything the update computes on them), a rollout as a trajectory (`trajectory`), where a step's
rollouts come from (`sources`: colocated or standalone workers; `staleness`), the weight-sync strategies the
sources hold (`weight_sync`: shared weights, replica refresh, load into an engine, push to workers), and
`text` (`scalerl generate`)."""

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.continuous import ContinuousEngine, GenerationRequest, RequestOutput
from scalerl.rollout.engines.engine import GenerationOutput, RolloutEngine, SamplingParams
from scalerl.rollout.engines.weight_loading import (
           EngineWeightStore,
           WeightLoadingEngine,
           engine_weight_receiver,
)

__all__ = ["BuiltinEngine", "ContinuousEngine", "EngineWeightStore", "GenerationOutput", "GenerationRequest",
           "RequestOutput", "RolloutBatch", "RolloutEngine", "SamplingParams", "WeightLoadingEngine",
           "engine_weight_receiver"]
