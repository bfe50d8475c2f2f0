"""Parallelism: the named mesh, `parallelize` (TP -> activation checkpointing -> DDP/FSDP2/HSDP), the DP
context the trainers use, sequence balancing, and the distributed-vs-single verification."""

from scalerl.parallel.balance import (
    balance_across_ranks,
    greedy_partition,
    karmarkar_karp,
    token_budget_micro_batches,
    token_imbalance,
)
from scalerl.parallel.distributed import DistContext, init_distributed, reduce_metrics
from scalerl.parallel.mesh import MESH_DIMS, LayoutError, ParallelDims
from scalerl.parallel.parallelize import parallelize

__all__ = [
    "DistContext", "LayoutError", "MESH_DIMS", "ParallelDims", "balance_across_ranks", "greedy_partition",
    "init_distributed", "karmarkar_karp", "parallelize", "reduce_metrics", "token_budget_micro_batches",
    "token_imbalance",
]
