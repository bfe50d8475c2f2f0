"""Gradient reduction: a DDP comm hook that reduces (flat or hierarchical) and optionally compresses.

- `reducer`: `GradientReducer` + `gradient_reduction_hook`, composing the rest; `setup`:
  `build_gradient_reducer()` from the ``comm`` config;
- `hierarchical`: intra-node reduce-scatter -> inter-node all-reduce per shard -> intra-node all-gather;
  `allreduce_choice`: `choose_allreduce()` for comm.allreduce=auto|flat|hierarchical, with the reason;
- `topk` (DGC top-k with error feedback and momentum correction), `powersgd` (per-tensor rank, error
  feedback), `layer_adaptive` (per-tensor settings under a byte budget), `compression_plan` (the settings
  in force, their metrics and log table), `bucket_slots` (each parameter's range in a DDP bucket).
"""
