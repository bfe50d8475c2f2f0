"""The `parallel` section: the device mesh's sizes (data-parallel replicate / shard, tensor, pipeline, expert,
sequence) and the pipeline schedule, with Ulysses' head rule that the mesh and the model checks share."""

from __future__ import annotations

from dataclasses import dataclass

from scalerl.core.config.tree import Section, _check, _check_choice, opt

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class ParallelSection(Section):
    name = "parallel"
    dp_replicate: int = opt(-1, "data-parallel replicas (DDP, or HSDP's replicate dim); -1 = all ranks left over")
    dp_shard: int = opt(1, "FSDP2 shard group size (>1 turns on FSDP; with dp_replicate>1, HSDP); -1 = left over")
    tp: int = opt(1, "tensor-parallel degree (heads and kv heads must divide by it)")
    pp: int = opt(1, "pipeline-parallel stages (layers must divide by it)")
    pp_schedule: str = opt("1f1b", "pipeline schedule: " + " | ".join(PP_SCHEDULES))
    microbatches: int = opt(4, "pipeline micro-batches per mini-batch")
    ep: int = opt(1, "expert parallelism: a MoE model's experts sharded over the data-parallel ranks, tokens routed "
                     "by all-to-all (1 = off; under DDP parallel.dp_replicate, under FSDP2 a divisor of "
                     "dp_replicate x dp_shard)")
    sp: int = opt(1, "Ulysses sequence parallelism: the sequence of update, log-prob and critic passes split over "
                     "sp ranks of each data-parallel replica, attention by all-to-all over heads (heads must divide "
                     "by sp; kv heads too, or divide sp); generation runs unsplit")
    reorder_ranks_by_node: bool = opt(True, "when the launcher numbered ranks across nodes in turn, build the "
                                            "device mesh with each node's ranks contiguous (rings cross nodes "
                                            "less; RANK numbers are kept)")

    def problems(self) -> list[str]:
        p: list[str] = []
        for key in ("dp_replicate", "dp_shard", "tp", "pp"):
            value = getattr(self, key)
            _check(p, value == -1 or value >= 1, f"parallel.{key}", ">= 1 or -1 (fill the world)", value)
        if self.dp_replicate == -1 and self.dp_shard == -1:
            p.append("only one of parallel.dp_replicate and parallel.dp_shard may be -1")
        _check(p, self.tp != -1 and self.pp != -1, "parallel.tp/pp", "explicit sizes (>= 1)", (self.tp, self.pp))
        _check_choice(p, "parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check(p, self.microbatches >= 1, "parallel.microbatches", ">= 1", self.microbatches)
        _check(p, self.ep >= 1, "parallel.ep", ">= 1", self.ep)
        _check(p, self.sp >= 1, "parallel.sp", ">= 1", self.sp)
        return p


def sequence_parallel_head_problems(sp: int, heads: int, kv_heads: int, prefix: str = "") -> list[str]:
    """Ulysses' head rule: each of the sp ranks attends with ``heads / sp`` query heads, so sp divides the
    heads; kv heads are split the same way, or, when fewer than sp, each replicated ``sp / kv_heads`` times
    (so kv heads must divide sp): a rank's query heads then read exactly one kv head."""
    p = []
    if sp > 1 and heads % sp:
        p.append(f"parallel.sp={sp} does not divide {prefix}num_attention_heads={heads}: Ulysses sequence "
                 "parallelism gives each sp rank num_attention_heads / sp heads")
    elif sp > 1 and kv_heads % sp and sp % kv_heads:
        p.append(f"parallel.sp={sp} and {prefix}num_key_value_heads={kv_heads} (num_attention_heads={heads}): kv "
                 "heads must divide by sp, or divide sp (each then replicated sp / num_key_value_heads times)")
    return p
