"""PowerSGD (Vogels et al., 2019) with a rank per tensor and error feedback.

torch's `powerSGD_hook` uses one rank for a whole bucket; layer-adaptive compression needs one per tensor,
so this is its own implementation of the same algorithm. For each matrix M (a gradient folded to
rows x columns, plus the error left from the last step):
    P = M Q_prev      -> all-reduce (sum) -> orthonormalise (QR)
    Q = M^T P         -> all-reduce (sum)
    approximation of the sum over ranks = P Q^T;   error = M - P Q^T / group size
Q is warm-started from the previous step (one power iteration per step suffices). Vectors and matrices
whose rank-r factors are no smaller than the matrix go through one dense all-reduce. Every rank ends
with the same P and Q, so replicas stay in sync.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from scalerl.comm.counting.counted_collectives import CountedCollectives


@dataclass(frozen=True)
class LowRankItem:
    """One tensor of a flat buffer: [offset, offset + rows x cols), compressed at `rank` (0 = dense)."""

    name: str
    offset: int
    rows: int
    cols: int
    rank: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def compressed(self) -> bool:
        return 0 < self.rank and self.rank * (self.rows + self.cols) < self.rows * self.cols


def powersgd_payload_bytes(rows: int, cols: int, rank: int, value_bytes: int = 4) -> int:
    """Bytes one rank contributes for a tensor: P and Q, or the dense values."""
    item = LowRankItem("", 0, rows, cols, rank)
    return rank * (rows + cols) * value_bytes if item.compressed else rows * cols * value_bytes


class PowerSGDReducer:
    """Keeps each tensor's Q and error between steps, keyed by (site, tensor name)."""

    def __init__(self, error_feedback: bool = True, seed: int = 0):
        self.error_feedback, self.seed = error_feedback, seed
        self.q: dict[object, torch.Tensor] = {}
        self.error: dict[object, torch.Tensor] = {}

    def _initial_q(self, key: object, cols: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        q = self.q.get(key)
        if q is None or q.shape != (cols, rank):
            # The same seed on every rank: all start from the same Q.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(repr(key).encode()))
            q = torch.randn(cols, rank, generator=gen, dtype=torch.float32).to(like.device, like.dtype)
        return q

    def reduce(self, flat: torch.Tensor, items: list[LowRankItem], group, collectives: CountedCollectives,
               site: object, scope: str) -> torch.Tensor:
        """SUM over `group` of every rank's `flat` items, compressed as each says, into `flat`.
        Elements outside the items are left as they are."""
        low = [it for it in items if it.compressed]
        dense = [it for it in items if not it.compressed]
        if dense:
            values = torch.cat([flat[it.offset:it.offset + it.numel] for it in dense])
            collectives.all_reduce(values, group, scope)
            offset = 0
            for it in dense:
                flat[it.offset:it.offset + it.numel] = values[offset:offset + it.numel]
                offset += it.numel
        if not low:
            return flat
        world = group.size()
        matrices, qs = [], []
        for it in low:
            m = flat[it.offset:it.offset + it.numel].view(it.rows, it.cols)
            key = (site, it.name)
            if self.error_feedback and key in self.error and self.error[key].shape == m.shape:
                m = m + self.error[key]
            matrices.append(m)
            qs.append(self._initial_q(key, it.cols, it.rank, m))
        ps = [m @ q for m, q in zip(matrices, qs)]
        packed = torch.cat([p.reshape(-1) for p in ps])
        collectives.all_reduce(packed, group, scope)
        ps = [torch.linalg.qr(p, mode="reduced").Q for p in _unpack(packed, [p.shape for p in ps])]
        qs = [m.T @ p for m, p in zip(matrices, ps)]
        packed = torch.cat([q.reshape(-1) for q in qs])
        collectives.all_reduce(packed, group, scope)
        qs = _unpack(packed, [q.shape for q in qs])
        for it, m, p, q in zip(low, matrices, ps, qs):
            approx = p @ q.T  # the sum over ranks, projected on P's span
            key = (site, it.name)
            if self.error_feedback:
                self.error[key] = m - approx / world
            self.q[key] = q / world
            flat[it.offset:it.offset + it.numel] = approx.reshape(-1)
        return flat


def _unpack(packed: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = shape[0] * shape[1]
        out.append(packed[offset:offset + n].view(shape))
        offset += n
    return out
