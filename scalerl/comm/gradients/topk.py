"""Top-k gradient sparsification with error feedback and momentum correction (Deep Gradient Compression,
Lin et al., 2018), exchanged as indices + values with all-gather.

Per reduction, on each rank, for a flat gradient g cut into segments of given densities:
    u = m u + g          (momentum correction; m = 0: u = g)
    acc = residual + u   (error feedback: what was not sent before is added back)
    send the k = ceil(density x len) largest |acc| of each segment (int32 index + value);
    residual = acc with the sent entries zeroed; u too (momentum factor masking).
Segments of density >= DENSE_DENSITY go through one dense all-reduce instead (a sparse entry costs
twice a dense one's bytes). The sum over ranks is rebuilt identically everywhere: each rank adds every
rank's (index, value) lists in group-rank order, so replicas stay bitwise in sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scalerl.comm.counting.counted_collectives import CountedCollectives
from scalerl.comm.gradients.bucket_slots import SlotSegment

DENSE_DENSITY = 0.5
INDEX_BYTES = 4  # int32 indices (a bucket or shard is far below 2^31 elements)


def topk_count(numel: int, density: float) -> int:
    return max(1, min(numel, math.ceil(density * numel)))


def is_dense(density: float) -> bool:
    return density >= DENSE_DENSITY


def topk_payload_bytes(numel: int, density: float, value_bytes: int = 4) -> int:
    """Bytes one rank contributes for a segment: dense values, or k (index, value) pairs."""
    if is_dense(density):
        return numel * value_bytes
    return topk_count(numel, density) * (INDEX_BYTES + value_bytes)


@dataclass
class _TopKState:
    residual: torch.Tensor
    momentum: torch.Tensor | None


class TopKExchange:
    """Keeps each reduction site's residual (and momentum) between steps, keyed by the caller."""

    def __init__(self, momentum: float = 0.0):
        self.momentum = momentum
        self.states: dict[object, _TopKState] = {}

    def _state(self, key: object, like: torch.Tensor) -> _TopKState:
        state = self.states.get(key)
        if state is None or state.residual.shape != like.shape:  # new site, or DDP rebuilt its buckets
            state = _TopKState(torch.zeros_like(like), torch.zeros_like(like) if self.momentum > 0 else None)
            self.states[key] = state
        return state

    def residual_of(self, key: object) -> torch.Tensor | None:
        state = self.states.get(key)
        return None if state is None else state.residual

    def reduce(self, flat: torch.Tensor, segments: list[SlotSegment], densities: list[float], group,
               collectives: CountedCollectives, key: object, scope: str) -> torch.Tensor:
        """SUM over `group` of every rank's compressed `flat` (1-D), written into `flat`; `densities[i]`
        applies to `segments[i]`. Positions outside the segments come back as zero."""
        state = self._state(key, flat)
        if state.momentum is not None:
            state.momentum.mul_(self.momentum).add_(flat)
            state.residual.add_(state.momentum)
        else:
            state.residual.add_(flat)
        acc = state.residual  # the accumulated gradient; what is sent is removed from it below
        sparse = [(s, d) for s, d in zip(segments, densities) if not is_dense(d)]
        dense = [s for s, d in zip(segments, densities) if is_dense(d)]

        out = torch.zeros_like(flat)
        if dense:
            values = torch.cat([acc[s.lo:s.hi] for s in dense])
            collectives.all_reduce(values, group, scope)
            offset = 0
            for s in dense:
                out[s.lo:s.hi] = values[offset:offset + s.numel]
                offset += s.numel
                self._clear(state, s.lo, s.hi)
        if sparse:
            index_parts, value_parts = [], []
            for s, d in sparse:
                k = topk_count(s.numel, d)
                idx = acc[s.lo:s.hi].abs().topk(k, sorted=False).indices + s.lo
                index_parts.append(idx)
                value_parts.append(acc[idx])
            indices = torch.cat(index_parts)
            values = torch.cat(value_parts)
            acc[indices] = 0  # sent: no longer owed
            if state.momentum is not None:
                state.momentum[indices] = 0
            world = group.size()
            all_indices = torch.empty(world * indices.numel(), dtype=torch.int32, device=flat.device)
            all_values = torch.empty(world * values.numel(), dtype=values.dtype, device=flat.device)
            collectives.all_gather(all_indices, indices.to(torch.int32), group, scope)
            collectives.all_gather(all_values, values, group, scope)
            # One index_add_ per rank: no index repeats inside one call, so the result is deterministic.
            for idx, val in zip(all_indices.long().chunk(world), all_values.chunk(world)):
                out.index_add_(0, idx, val)
        flat.copy_(out)
        return flat

    @staticmethod
    def _clear(state: _TopKState, lo: int, hi: int) -> None:
        state.residual[lo:hi] = 0
        if state.momentum is not None:
            state.momentum[lo:hi] = 0


def sparse_elements_sent(segments: list[SlotSegment], densities: list[float]) -> int:
    """Elements a rank sends as (index, value) pairs for these segments (the dense ones excluded)."""
    return sum(topk_count(s.numel, d) for s, d in zip(segments, densities) if not is_dense(d))

