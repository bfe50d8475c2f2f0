"""Parallelism: the named mesh, `parallelize` (pipeline stages -> TP -> EP -> Ulysses sequence parallel
(`sequence_parallel`) -> activation checkpointing -> DDP/FSDP2/HSDP) and the model parts it returns, the run's
distributed context (joined within limits: `rendezvous`; failed collectives described: `collective_failures`,
`rank_liveness`), metric reduction over ranks, gradient-norm clipping, and sequence-length balancing."""

from scalerl.parallel.distributed import DistContext, init_distributed
from scalerl.parallel.mesh import MESH_DIMS, LayoutError, ParallelDims
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.parallel.parallelize import (
    MicroBatch,
    ModuleParts,
    PipelineOptions,
    PipelineParts,
    parallelize,
)
from scalerl.parallel.seqlen_balance import (
    balance_across_ranks,
    greedy_partition,
    karmarkar_karp,
    token_budget_micro_batches,
    token_imbalance,
)

__all__ = [
    "DistContext", "LayoutError", "MESH_DIMS", "MicroBatch", "ModuleParts", "ParallelDims", "PipelineOptions",
    "PipelineParts", "balance_across_ranks", "greedy_partition", "init_distributed", "karmarkar_karp",
    "parallelize", "reduce_metrics", "token_budget_micro_batches", "token_imbalance",
]
