"""The layout both ends of a weight sync agree on: which tensors, in which order, cut into which buckets.

All tensors are laid end to end as one flat run of elements (in the sender's parameter order); bucket
``b`` is elements ``[b * bucket_elems, (b + 1) * bucket_elems)`` of it. A tensor larger than a bucket
spans several; many tiny tensors share one. The sender ships the plan as JSON (never pickle) with every
full push, and its hash with every sync, so a receiver never applies a delta against another layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    start: int  # first element in the flat run

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class BucketSegment:
    """Elements ``[tensor_start, tensor_stop)`` of tensor ``entry`` sit at ``bucket_offset`` of a bucket."""

    entry: TensorEntry
    tensor_start: int
    tensor_stop: int
    bucket_offset: int

    @property
    def numel(self) -> int:
        return self.tensor_stop - self.tensor_start

    @property
    def completes_tensor(self) -> bool:
        return self.tensor_stop == self.entry.numel


class WeightPlan:
    def __init__(self, shapes: Sequence[tuple[str, Sequence[int]]], dtype: torch.dtype, bucket_elems: int):
        if bucket_elems < 1:
            raise ValueError(f"a bucket needs at least one element, got {bucket_elems}")
        if dtype not in DTYPE_NAMES.values():
            raise ValueError(f"unsupported rollout dtype {dtype}")
        self.dtype, self.bucket_elems = dtype, bucket_elems
        self.entries: list[TensorEntry] = []
        start = 0
        for name, shape in shapes:
            entry = TensorEntry(name, tuple(int(s) for s in shape), start)
            self.entries.append(entry)
            start = entry.stop
        self._index = {e.name: i for i, e in enumerate(self.entries)}
        if len(self._index) != len(self.entries):
            raise ValueError("weight sync needs unique tensor names")
        self.total_elems = start
        self.num_buckets = max(1, math.ceil(start / bucket_elems))

    @classmethod
    def for_bucket_bytes(cls, shapes: Sequence[tuple[str, Sequence[int]]], dtype: torch.dtype,
                         bucket_bytes: int) -> WeightPlan:
        element = torch.empty((), dtype=dtype).element_size()
        return cls(shapes, dtype, max(1, bucket_bytes // element))

    def index_of(self, name: str) -> int:
        return self._index[name]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def full_bytes(self) -> int:
        """What one dense push of every tensor in the rollout dtype carries."""
        return self.total_elems * self.element_size

    def bucket_range(self, b: int) -> tuple[int, int]:
        start = b * self.bucket_elems
        return start, min(start + self.bucket_elems, self.total_elems)

    def segments(self, b: int) -> list[BucketSegment]:
        """The tensor pieces of bucket ``b``, in order."""
        lo, hi = self.bucket_range(b)
        out = []
        for entry in self._entries_overlapping(lo, hi):
            s, e = max(lo, entry.start), min(hi, entry.stop)
            if e > s:
                out.append(BucketSegment(entry, s - entry.start, e - entry.start, s - lo))
        return out

    def _entries_overlapping(self, lo: int, hi: int) -> Iterable[TensorEntry]:
        # Binary search for the first entry ending after `lo`; plans hold up to thousands of tensors.
        left, right = 0, len(self.entries)
        while left < right:
            mid = (left + right) // 2
            if self.entries[mid].stop <= lo:
                left = mid + 1
            else:
                right = mid
        for entry in self.entries[left:]:
            if entry.start >= hi:
                break
            yield entry

    # ------------------------------------------------------------------------------------ wire format
    def to_json(self) -> str:
        dtype_name = next(k for k, v in DTYPE_NAMES.items() if v == self.dtype)
        return json.dumps({"dtype": dtype_name, "bucket_elems": self.bucket_elems,
                           "tensors": [[e.name, list(e.shape)] for e in self.entries]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WeightPlan:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("dtype") not in DTYPE_NAMES:
            raise ValueError("not a weight plan (missing or unknown dtype)")
        tensors = data.get("tensors")
        if not isinstance(tensors, list) or not all(
            isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and isinstance(t[1], list)
            and all(isinstance(s, int) and s >= 0 for s in t[1]) for t in tensors
        ):
            raise ValueError("weight plan tensors must be [name, [sizes...]] pairs")
        return cls([(n, s) for n, s in tensors], DTYPE_NAMES[data["dtype"]], int(data["bucket_elems"]))

    def hash64(self) -> int:
        """A signed 64-bit digest of the plan (sent with every sync; fits an int64 header field)."""
        digest = hashlib.sha256(self.to_json().encode()).digest()
        return int.from_bytes(digest[:8], "little", signed=True)
