"""Where each parameter's gradient sits in a DDP bucket's flat buffer, and what kind of tensor it is.

DDP packs several parameters' gradients into one bucket, in the order of `bucket.parameters()`; per-tensor
compression decisions need each one's range. The kind (embedding, output head, norm, bias, matrix) is read
from the parameter's name and shape: the layer-adaptive allocation treats them differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("embedding", "head", "norm", "vector", "matrix")
SENSITIVE_KINDS = ("embedding", "head", "norm")


@dataclass(frozen=True)
class TensorSlot:
    name: str
    offset: int  # first element in the bucket's flat buffer
    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def matrix_shape(self) -> tuple[int, int] | None:
        """(rows, columns) it is compressed as (dims after the first folded), or None for a vector."""
        if len(self.shape) < 2:
            return None
        return self.shape[0], self.numel // self.shape[0]


def tensor_kind(name: str, shape: tuple[int, ...]) -> str:
    lowered = name.lower()
    if "norm" in lowered or (len(shape) == 1 and lowered.endswith(("ln.weight", "ln_f.weight"))):
        return "norm"
    if len(shape) < 2:
        return "vector"
    if "embed" in lowered or "wte" in lowered:
        return "embedding"
    if "lm_head" in lowered or "value_head" in lowered or lowered.endswith(("head.weight", "output.weight")):
        return "head"
    return "matrix"


def bucket_slots(params: list[torch.nn.Parameter], names: dict[int, str]) -> list[TensorSlot]:
    """Slots of the parameters of one bucket, in buffer order; `names` maps id(parameter) -> name."""
    slots, offset = [], 0
    for i, p in enumerate(params):
        name = names.get(id(p), f"param{i}")
        shape = tuple(p.shape)
        slots.append(TensorSlot(name, offset, shape, tensor_kind(name, shape)))
        offset += p.numel()
    return slots


@dataclass(frozen=True)
class SlotSegment:
    """Part of one slot inside a range of the buffer: [lo, hi) relative to the range's start."""

    slot: int  # index into the slot list
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def segments_in(slots: list[TensorSlot], start: int, end: int) -> list[SlotSegment]:
    """The slots' parts that fall in [start, end) (e.g. a hierarchical shard), relative to `start`."""
    out = []
    for i, s in enumerate(slots):
        lo, hi = max(s.offset, start), min(s.end, end)
        if lo < hi:
            out.append(SlotSegment(i, lo - start, hi - start))
    return out
