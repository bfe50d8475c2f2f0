"""The rollout engines: what generates the tokens. The interface every engine implements (`engine`: sampling
parameters, outputs, `RolloutEngine`), the built-in KV-cache engine (`builtin`, which compacts finished rows)
and its continuous batching (`continuous`: a request queue, freed slots refilled), the optional vLLM
adapters (`vllm`, `vllm_async`, with `vllm_weight_loading`), `rollout.engine=auto` decided once (`choice`),
and how an engine with its own weights takes the trainer's pushes (`weight_loading`)."""
