"""What crosses the wire besides activations: the `comm` section (how data-parallel gradients are reduced and
compressed) and `weight_sync` (how the trainer's weights reach rollout engines holding their own copy)."""

from __future__ import annotations

from dataclasses import dataclass

from scalerl.core.config.tree import Section, _check, _check_choice, opt

ALLREDUCE_KINDS = ("auto", "flat", "hierarchical")
GRADIENT_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")
# Compressions that need DDP's per-bucket hooks; FSDP reduce-scatters shards and has no such hook.
HOOK_ONLY_COMPRESSIONS = ("powersgd", "topk")
WEIGHT_SYNC_MODES = ("full", "delta", "auto")


@dataclass
class CommSection(Section):
    """How data-parallel gradients are reduced (DDP comm hooks; see docs/comm-compression.md)."""

    name = "comm"
    allreduce: str = opt("auto", "gradient all-reduce: auto (hierarchical when the inter-node link is much slower "
                                 "than intra-node, else flat) | flat | hierarchical (intra-node reduce-scatter, "
                                 "inter-node all-reduce, intra-node all-gather)")
    inter_node_mbit: float = opt(0.0, "inter-node link rate in Mbit/s for comm.allreduce=auto when sysfs cannot tell "
                                      "(virtual or shaped links); 0 = read it from the topology", at_least=0)
    gradient_compression: str = opt("none", "DDP gradient compression: " + " | ".join(GRADIENT_COMPRESSIONS) +
                                    "; powersgd and topk keep an error-feedback residual")
    layer_adaptive: bool = opt(True, "powersgd/topk: per-tensor rank/density chosen from measured gradient "
                                     "statistics under comm.compression_budget (else comm.topk_density / "
                                     "comm.powersgd_rank for every tensor)")
    compression_budget: float = opt(0.1, "layer-adaptive: bytes each rank contributes per reduction, as a fraction "
                                         "of the dense fp32 gradient's bytes (0.1 = 90% fewer)", above=0, at_most=1)
    topk_density: float = opt(0.01, "topk without layer_adaptive: fraction of each tensor's elements sent",
                              above=0, at_most=1)
    topk_momentum: float = opt(0.0, "topk: Deep Gradient Compression momentum correction factor (momentum "
                                    "accumulated before sparsification); 0 = plain error feedback, which suits "
                                    "AdamW (it keeps its own moments)", at_least=0, below=1)
    powersgd_rank: int = opt(4, "powersgd without layer_adaptive: rank of every matrix's approximation")
    compression_start_step: int = opt(10, "powersgd/topk: optimizer steps of dense all-reduce before compressing "
                                          "(warm-up; layer-adaptive measures its statistics there, so it "
                                          "takes at least 1)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "comm.allreduce", self.allreduce, ALLREDUCE_KINDS)
        _check(p, self.inter_node_mbit >= 0, "comm.inter_node_mbit", ">= 0 (0 = detect)", self.inter_node_mbit)
        _check_choice(p, "comm.gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
        _check(p, 0 < self.compression_budget <= 1, "comm.compression_budget", "in (0, 1]", self.compression_budget)
        _check(p, 0 < self.topk_density <= 1, "comm.topk_density", "in (0, 1]", self.topk_density)
        _check(p, 0 <= self.topk_momentum < 1, "comm.topk_momentum", "in [0, 1)", self.topk_momentum)
        _check(p, self.powersgd_rank >= 1, "comm.powersgd_rank", ">= 1", self.powersgd_rank)
        _check(p, self.compression_start_step >= 0, "comm.compression_start_step", ">= 0",
               self.compression_start_step)
        return p


@dataclass
class WeightSyncSection(Section):
    """Pushing the trainer's weights to rollout engines that hold their own copy (scalerl/comm/weights/sender.py)."""

    name = "weight_sync"
    mode: str = opt("delta", "full (dense push every sync) | delta (only elements whose rollout.dtype bits "
                    "changed; lossless, verified by checksums) | auto (per sync, deltas or dense buckets, "
                    "whichever has cost less time per element: dense next to the trainer, deltas over slow links)")
    bucket_mb: float = opt(64.0, "bucket size in MiB of rollout.dtype elements: tensors are gathered and sent one "
                           "bucket at a time, bounding the extra memory", above=0)
    static_every: int = opt(0, "lossy option: defer a tensor whose largest change since its last push is below "
                            "static_threshold for up to this many syncs; 0 = off (lossless)")
    static_threshold: float = opt(0.0, "lossy option: largest absolute change a deferred tensor may carry",
                                  at_least=0)
    background: bool = opt(True, "standalone workers with rollout.staleness >= 1: after the optimizer step, the "
                                 "trainer takes a snapshot of the weights and a background thread pushes it, so "
                                 "the next step does not wait "
                                 "for the push (false: the push runs in the step)")
    timeout_s: float = opt(120.0, "standalone workers: the longest one step of a weight push may take (the trainer "
                                  "preparing a bucket, sending it and every worker acknowledging it); a push that "
                                  "overruns it stops the run naming the side and the bucket that is stuck (the "
                                  "trainer sending, or which worker receiving) instead of waiting on the "
                                  "collective's own limit; the workers joining the push (after the requests "
                                  "queued before it) have trainer.dist_timeout_s", above=0)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "weight_sync.mode", self.mode, WEIGHT_SYNC_MODES)
        _check(p, self.static_every >= 0, "weight_sync.static_every", ">= 0 (0 = off)", self.static_every)
        if self.static_every > 0 and self.mode != "delta":
            p.append(f"weight_sync.static_every={self.static_every} defers tensors between delta syncs; "
                     f"it needs weight_sync.mode=delta, got {self.mode!r}")
        if self.static_every > 0 and self.static_threshold <= 0:
            p.append("weight_sync.static_every > 0 needs weight_sync.static_threshold > 0 "
                     "(the largest change a deferred tensor may carry)")
        return p
