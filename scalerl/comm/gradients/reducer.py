"""DDP gradient reduction: flat or hierarchical all-reduce, optionally compressed, as one comm hook.

    reducer = GradientReducer(group, settings, choice, hierarchy, param_names)
    ddp.register_comm_hook(reducer, gradient_reduction_hook)

Each bucket is averaged (divided by the group size first, so fp16 cannot overflow) and then reduced:
- none: all-reduce (flat: async, so it overlaps the rest of backward as DDP's own does);
- fp16 / bf16: cast, all-reduce, cast back (torch's bf16 hook refuses gloo, so the cast is ours);
- topk / powersgd: dense for `start_step` optimizer steps (warm-up; layer-adaptive measures its
  statistics on the last of them), then compressed with error feedback.
Under the hierarchical all-reduce only the inter-node part is compressed: the intra-node reduce-scatter
and all-gather stay dense (top-k and casts act on each rank's shard of its node's sum); PowerSGD, whose
matrices do not split into shards, all-reduces inside the node, compresses each tensor on one local
rank across nodes, and shares the results inside the node.
Compressed and hierarchical reductions run their collectives in the hook (gloo: blocking, no overlap
with the rest of backward; NCCL: queued on the stream).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scalerl.comm.counting.collective_bytes import wire_bytes
from scalerl.comm.counting.counted_collectives import CountedCollectives, SendCallback
from scalerl.comm.gradients.allreduce_choice import AllReduceChoice
from scalerl.comm.gradients.bucket_slots import TensorSlot, bucket_slots, segments_in
from scalerl.comm.gradients.compression_plan import (
    CompressionPlan,
    adaptive_plan,
    uniform_plan,
)
from scalerl.comm.gradients.hierarchical import (
    HierarchicalGroups,
    hierarchical_all_reduce,
)
from scalerl.comm.gradients.layer_adaptive import TensorStats, measure
from scalerl.comm.gradients.powersgd import LowRankItem, PowerSGDReducer
from scalerl.comm.gradients.topk import TopKExchange

logger = logging.getLogger("scalerl.comm")
CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
STAT_STEPS = {"topk": 3, "powersgd": 1}  # warm-up steps measured (PowerSGD's SVDs cost more)


@dataclass(frozen=True)
class CompressionSettings:
    method: str = "none"  # none | fp16 | bf16 | powersgd | topk
    layer_adaptive: bool = True
    budget: float = 0.1
    topk_density: float = 0.01
    topk_momentum: float = 0.0
    powersgd_rank: int = 4
    start_step: int = 10

    @classmethod
    def from_config(cls, comm) -> CompressionSettings:
        return cls(comm.gradient_compression, comm.layer_adaptive, comm.compression_budget, comm.topk_density,
                   comm.topk_momentum, comm.powersgd_rank, comm.compression_start_step)

    @property
    def sparse_or_low_rank(self) -> bool:
        return self.method in ("topk", "powersgd")

    @property
    def effective_start(self) -> int:
        """Layer-adaptive needs one measured dense step at least."""
        return max(self.start_step, 1) if self.layer_adaptive and self.sparse_or_low_rank else self.start_step


class GradientReducer:
    """The state of the comm hook: counters, residuals, statistics and the per-tensor plan."""

    def __init__(self, group, settings: CompressionSettings, choice: AllReduceChoice,
                 hierarchy: HierarchicalGroups | None, param_names: dict[int, str], on_send: SendCallback | None = None,
                 announce=None):
        if choice.hierarchical and hierarchy is None:
            raise ValueError("a hierarchical all-reduce needs its HierarchicalGroups")
        self.group, self.settings, self.choice = group, settings, choice
        self.hierarchy = hierarchy if choice.hierarchical else None
        self.param_names = param_names
        self.collectives = CountedCollectives(on_send)
        self.topk = TopKExchange(settings.topk_momentum)
        self.powersgd = PowerSGDReducer()
        self.announce = announce or (lambda text: None)
        self.step = 0  # completed reductions of the whole model (optimizer steps)
        self.slots: dict[str, TensorSlot] = {}  # every tensor seen, for a plan over all buckets
        self.stats: dict[str, TensorStats] = {}
        self.plan: CompressionPlan | None = None
        self.dense_fp32_bytes = 0

    @property
    def compressing(self) -> bool:
        return self.settings.sparse_or_low_rank and self.step >= self.settings.effective_start

    def _measuring(self, step: int) -> bool:
        """Layer-adaptive statistics are measured on the averaged gradients of the last warm-up steps."""
        s = self.settings
        return s.sparse_or_low_rank and s.layer_adaptive and \
            s.effective_start - STAT_STEPS[s.method] <= step < s.effective_start

    # ---- one bucket ----
    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer, params = bucket.buffer(), bucket.parameters()
        slots = bucket_slots(params, self.param_names)
        for s in slots:
            self.slots.setdefault(s.name, s)
        world = self.group.size()
        self.dense_fp32_bytes += wire_bytes("all_reduce", buffer.numel() * 4, world)
        buffer.div_(world)
        method, step = self.settings.method, self.step
        fut = None
        if method in CAST_DTYPES:
            self._cast(buffer, CAST_DTYPES[method])
        elif self.settings.sparse_or_low_rank and step >= self.settings.effective_start:
            self._ensure_plan()
            key = tuple(s.name for s in slots)  # DDP may rebuild buckets after its first step
            (self._topk if method == "topk" else self._powersgd)(buffer, slots, key)
        elif self.hierarchy is not None:
            hierarchical_all_reduce(buffer, self.hierarchy, self.collectives)
        else:
            fut = self._flat_async(buffer)
        if self._measuring(step):
            if fut is not None:
                fut.wait()
            self._measure(slots, buffer, params)
        if bucket.is_last():
            self.step += 1
        if fut is None:
            fut = torch.futures.Future()
            fut.set_result(buffer)
        return fut

    def _flat_async(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """DDP's own all-reduce, async so it overlaps the rest of backward (its duration is not known here)."""
        work = self.collectives.all_reduce(buffer, self.group, "flat", async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def _cast(self, buffer: torch.Tensor, dtype: torch.dtype) -> None:
        if self.hierarchy is not None:  # only the inter-node step is cast
            hierarchical_all_reduce(buffer, self.hierarchy, self.collectives, inter_dtype=dtype)
            return
        low = buffer.to(dtype)
        self.collectives.all_reduce(low, self.group, "flat")
        buffer.copy_(low)

    def _topk(self, buffer: torch.Tensor, slots: list[TensorSlot], key: tuple) -> None:
        def densities(segments):
            return [self.plan.setting(slots[seg.slot].name) for seg in segments]

        if self.hierarchy is None:
            segments = segments_in(slots, 0, buffer.numel())
            self.topk.reduce(buffer, segments, densities(segments), self.group, self.collectives, (key, "flat"), "flat")
            return
        h = self.hierarchy
        start, end = h.shard_bounds(buffer.numel())
        segments = segments_in(slots, start, min(end, buffer.numel()))
        hierarchical_all_reduce(buffer, h, self.collectives, inter_reduce=lambda shard: self.topk.reduce(
            shard, segments, densities(segments), h.inter, self.collectives, (key, "inter"), "inter"))

    def _powersgd(self, buffer: torch.Tensor, slots: list[TensorSlot], key: tuple) -> None:
        items = [LowRankItem(s.name, s.offset, *(s.matrix_shape or (s.numel, 1)), int(self.plan.setting(s.name)))
                 for s in slots]
        if self.hierarchy is None:
            self.powersgd.reduce(buffer, items, self.group, self.collectives, (key, "flat"), "flat")
            return
        h = self.hierarchy
        self.collectives.all_reduce(buffer, h.intra, "intra")  # every local rank holds its node's sum
        owner = owner_of(items, h.local_size)
        mine = [it for it in items if owner[it.name] == h.local_rank]
        out = torch.zeros_like(buffer)
        if mine:
            self.powersgd.reduce(buffer, mine, h.inter, self.collectives, (key, "inter"), "inter")
            for it in mine:
                out[it.offset:it.offset + it.numel] = buffer[it.offset:it.offset + it.numel]
        self.collectives.all_reduce(out, h.intra, "intra")  # each tensor's result from its owner
        buffer.copy_(out)

    # ---- statistics and the plan ----
    def _measure(self, slots: list[TensorSlot], averaged: torch.Tensor, params) -> None:
        with_ranks = self.settings.method == "powersgd"
        for s, p in zip(slots, params):
            stats = self.stats.setdefault(s.name, TensorStats(s.numel, s.kind))
            stats.add(*measure(s, averaged[s.offset:s.end], p, with_ranks))

    def _ensure_plan(self) -> None:
        if self.plan is not None:
            return
        s = self.settings
        slots = [self.slots[name] for name in sorted(self.slots)]
        if s.layer_adaptive:
            plan = adaptive_plan(s.method, slots, self.stats, s.budget)
            # Statistics come from averaged gradients, identical on every rank; rank 0's plan is broadcast
            # anyway so that no rounding difference can give ranks different payload sizes.
            vector = torch.tensor(plan.as_vector(), dtype=torch.float64)
            if self.group_device().type == "cuda":
                vector = vector.cuda()
            self.collectives.broadcast(vector, self.group, "plan")
            plan = plan.with_vector(vector.cpu().tolist())
        else:
            plan = uniform_plan(s.method, slots, s.topk_density, s.powersgd_rank)
        self.plan = plan
        self.announce(f"gradient compression {s.method} from step {self.step}:\n{plan.describe(self.stats)}")

    def group_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")

    # ---- metrics ----
    def pop_metrics(self) -> dict[str, float]:
        """This rank's gradient traffic since the last call, the all-reduce choice and the plan."""
        sent, seconds = self.collectives.pop()
        dense, self.dense_fp32_bytes = self.dense_fp32_bytes, 0
        out = {"comm/grad/bytes_sent": float(sum(sent.values())), "comm/grad/dense_fp32_bytes": float(dense),
               "comm/grad/collective_seconds": float(sum(seconds.values())),
               "comm/compression/active": float(self.compressing), **self.choice.metrics()}
        if self.plan is not None:
            out.update(self.plan.metrics())
        return out


def owner_of(items: list[LowRankItem], local_size: int) -> dict[str, int]:
    """Which local rank compresses each tensor across nodes: largest first to the least loaded."""
    load = [0] * local_size
    owner = {}
    for it in sorted(items, key=lambda it: (-it.numel, it.name)):
        j = min(range(local_size), key=lambda r: (load[r], r))
        owner[it.name] = j
        load[j] += it.numel
    return owner


def gradient_reduction_hook(state: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: `ddp.register_comm_hook(reducer, gradient_reduction_hook)`."""
    return state.reduce(bucket)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
gradient_reduction_hook.__annotations__ = {"state": GradientReducer, "bucket": dist.GradBucket,
                                           "return": torch.futures.Future[torch.Tensor]}


def merged_comm_metrics(reducers: list[GradientReducer]) -> dict[str, float]:
    """One step's metrics of several reducers (e.g. the policy's and the critic's): traffic summed, the
    first reducer's choice and plan."""
    parts = [r.pop_metrics() for r in reducers]
    if not parts:
        return {}
    out = dict(parts[0])
    for key in ("comm/grad/bytes_sent", "comm/grad/dense_fp32_bytes", "comm/grad/collective_seconds"):
        out[key] = sum(p[key] for p in parts)
    dense = out["comm/grad/dense_fp32_bytes"]
    out["comm/grad/bytes_saved_fraction"] = 1.0 - out["comm/grad/bytes_sent"] / dense if dense else 0.0
    return out
