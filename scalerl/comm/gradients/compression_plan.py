"""The per-tensor settings a compressed reduction uses: a top-k density or a PowerSGD rank for each tensor,
uniform (comm.topk_density / comm.powersgd_rank) or layer-adaptive (`scalerl.comm.gradients.layer_adaptive`), and
what they are reported as (metrics, a log table)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalerl.comm.gradients.bucket_slots import SENSITIVE_KINDS, TensorSlot
from scalerl.comm.gradients.layer_adaptive import (
    TensorStats,
    allocate_densities,
    allocate_ranks,
)
from scalerl.comm.gradients.powersgd import powersgd_payload_bytes
from scalerl.comm.gradients.topk import topk_count, topk_payload_bytes

FLOAT_BYTES = 4
COMPRESSIBLE_KINDS = ("embedding", "head", "matrix")  # vectors and norms always go dense


@dataclass(frozen=True)
class CompressionPlan:
    method: str  # "topk" | "powersgd"
    slots: tuple[TensorSlot, ...]  # every tensor the plan covers (offsets are not used)
    settings: dict[str, float]  # name -> density (topk, 1.0 = dense) or rank (powersgd, 0 = dense)
    adaptive: bool

    def setting(self, name: str) -> float:
        return self.settings[name]

    def payload_bytes(self, slot: TensorSlot) -> int:
        s = self.settings[slot.name]
        if self.method == "topk":
            return topk_payload_bytes(slot.numel, s)
        shape = slot.matrix_shape or (slot.numel, 1)
        return powersgd_payload_bytes(*shape, int(s))

    def bytes_fraction(self, slot: TensorSlot) -> float:
        return self.payload_bytes(slot) / (slot.numel * FLOAT_BYTES)

    def metrics(self) -> dict[str, float]:
        dense = sum(s.numel for s in self.slots) * FLOAT_BYTES
        out = {"comm/compression/budget_used": sum(self.payload_bytes(s) for s in self.slots) / dense}
        for group, kinds in (("sensitive", SENSITIVE_KINDS), ("matrix", ("matrix",))):
            fractions = [self.bytes_fraction(s) for s in self.slots if s.kind in kinds]
            if fractions:
                out[f"comm/compression/bytes_fraction/{group}"] = sum(fractions) / len(fractions)
        if self.method == "topk":
            sent = sum(topk_count(s.numel, self.settings[s.name]) for s in self.slots)
            out["comm/compression/density/mean"] = sent / sum(s.numel for s in self.slots)
        else:
            ranks = [self.settings[s.name] for s in self.slots if self.settings[s.name] > 0]
            out["comm/compression/rank/mean"] = sum(ranks) / len(ranks) if ranks else 0.0
        return out

    def describe(self, stats: dict[str, TensorStats] | None = None) -> str:
        unit = "density" if self.method == "topk" else "rank"
        lines = [f"{'tensor':48s} {'kind':9s} {'shape':>14s} {unit:>9s} {'bytes/dense':>11s} {'|g|/|w|':>9s}"]
        for s in self.slots:
            value = self.settings[s.name]
            shown = ("dense" if value >= 1.0 else f"{value:.2e}") if self.method == "topk" else \
                ("dense" if value == 0 else f"{int(value)}")
            rho = f"{stats[s.name].rho:9.2e}" if stats and s.name in stats else f"{'-':>9s}"
            lines.append(f"{s.name[-48:]:48s} {s.kind:9s} {'x'.join(map(str, s.shape)):>14s} {shown:>9s} "
                         f"{self.bytes_fraction(s):11.4f} {rho}")
        used = self.metrics()["comm/compression/budget_used"]
        lines.append(f"bytes per reduction: {used:.4f} of dense fp32 ({'layer-adaptive' if self.adaptive else 'uniform'})")
        return "\n".join(lines)

    def as_vector(self) -> list[float]:
        return [float(self.settings[s.name]) for s in self.slots]

    def with_vector(self, values: list[float]) -> CompressionPlan:
        """The same plan with settings taken from `values` (in slot order), e.g. rank 0's broadcast."""
        cast = float if self.method == "topk" else (lambda v: int(round(v)))
        return CompressionPlan(self.method, self.slots, {s.name: cast(v) for s, v in zip(self.slots, values)},
                               self.adaptive)


def uniform_plan(method: str, slots: list[TensorSlot], density: float, rank: int) -> CompressionPlan:
    """Every matrix at `density` / `rank`; vectors and norms dense."""
    settings: dict[str, float] = {}
    for s in slots:
        compressible = s.kind in COMPRESSIBLE_KINDS
        if method == "topk":
            settings[s.name] = density if compressible else 1.0
        else:
            settings[s.name] = rank if compressible and s.matrix_shape is not None else 0
    return CompressionPlan(method, tuple(slots), settings, adaptive=False)


def adaptive_plan(method: str, slots: list[TensorSlot], stats: dict[str, TensorStats], budget: float) -> CompressionPlan:
    """Per-tensor settings from measured statistics under `budget` (see `scalerl.comm.gradients.layer_adaptive`). A
    tensor first seen after the measured steps gets neutral statistics (the median ratio, energy curves
    of a flat gradient)."""
    stats = {s.name: stats.get(s.name) or TensorStats(s.numel, s.kind, rho=math.nan) for s in slots}
    if method == "topk":
        settings = allocate_densities(slots, stats, budget)
    else:
        settings = allocate_ranks(slots, stats, budget)
    return CompressionPlan(method, tuple(slots), settings, adaptive=True)
