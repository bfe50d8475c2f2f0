"""Lossless encoding of one weight bucket's change, and the checksum that verifies what a receiver holds.

A bucket is a flat run of elements in the rollout dtype, handled as their bit patterns (``int16`` for
bf16, ``int32`` for fp32), so "changed" means "a different bit pattern" and every decode is exact.

An encoded bucket is up to two byte streams, each stored raw or zlib-compressed, whichever is shorter:

- positions of the changed elements: ``GAPS`` (LEB128 varints of the gaps between consecutive changed
  indices) or ``BITMASK`` (one bit per element); ``ALL`` means every element has a value (no stream);
- values: ``RAW`` (the new bit patterns) or ``DIFF`` (zigzag varints of the wrapping difference new - old
  of the bit patterns; a one-ulp step, the common change under small learning rates, is one byte, and a
  run of them compresses to a few bits).

``encode_bucket`` builds the candidates and keeps the smallest, the dense bucket (``ALL`` + ``RAW``)
included; which one wins depends on how many elements changed (docs/weight-sync.md has the measurements).
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from scalerl.comm.weights.varints import (
    CHUNK,
    DecodeError,
    apply_diff_varints,
    diff_varints,
    varint_chunks,
    varint_encode,
)

# zlib level 1: on the demo's GRPO deltas level 6 made streams 1-33% smaller (mostly 10-15%) at 10-40x the
# time (tens of ms per 100 KiB on this CPU, more than sending the difference over a 200 Mbit link takes).
ZLIB_LEVEL = 1
MIN_COMPRESS_BYTES = 64  # shorter streams are not worth a zlib header
# zlib runs at ~10-40 MB/s on barely compressible streams on this (shared, 2-core) CPU, slower than the
# 25 MB/s of a 200 Mbit link: a large stream is compressed only when a probe of its first PROBE_BYTES
# saves at least MIN_SAVING (fp32 differences probed at ~12% and saved 9%: not worth it).
PROBE_BYTES = 64 * 1024
MIN_SAVING = 0.25
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
NUMPY_INT = {torch.int16: np.int16, torch.int32: np.int32}


class Positions(IntEnum):
    ALL = 0
    GAPS = 1
    BITMASK = 2


class Values(IntEnum):
    RAW = 0
    DIFF = 1


@dataclass
class EncodedBucket:
    """One bucket's change. ``payload`` = positions stream (``positions_nbytes`` bytes) + values stream."""

    positions: Positions
    values: Values
    positions_zlib: bool
    values_zlib: bool
    changed: int  # elements whose bit pattern changed (all of them for a dense push)
    positions_nbytes: int
    payload: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def name(self) -> str:
        """``gaps+diff(z)``, ``all+raw`` (the dense bucket), ...: ``(z)`` marks a zlib-compressed stream;
        ``unchanged`` for an empty change."""
        if self.positions != Positions.ALL and self.changed == 0:
            return "unchanged"
        positions = self.positions.name.lower() + ("(z)" if self.positions_zlib else "")
        return f"{positions}+{self.values.name.lower()}{'(z)' if self.values_zlib else ''}"


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in INT_VIEW:
        raise ValueError(f"weight sync supports bfloat16, float16 and float32 rollout weights, not {dtype}")
    return INT_VIEW[dtype]


# --------------------------------------------------------------------------------------------- streams
def _smaller_stream(data: bytes | memoryview) -> tuple[bytes | memoryview, bool]:
    """``data`` or its zlib compression, whichever is shorter, and whether it is compressed."""
    if len(data) < MIN_COMPRESS_BYTES:
        return data, False
    if len(data) > 2 * PROBE_BYTES and len(zlib.compress(data[:PROBE_BYTES], ZLIB_LEVEL)) > (1 - MIN_SAVING) * PROBE_BYTES:
        return data, False
    packed = zlib.compress(data, ZLIB_LEVEL)
    return (packed, True) if len(packed) < len(data) else (data, False)


def _best_stream(options: list[tuple[bytes, IntEnum]]) -> tuple[bytes | memoryview, bool, IntEnum]:
    """Of alternative streams for one role, the one that ends up smallest (raw or compressed)."""
    return min(((*_smaller_stream(data), kind) for data, kind in options), key=lambda c: len(c[0]))


def _inflate(data: bytes, limit: int) -> bytes:
    """zlib-decompress at most ``limit`` bytes (a stream claiming more is refused, not expanded)."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, limit)
    except zlib.error as err:
        raise DecodeError(f"corrupt zlib stream: {err}") from err
    if inflater.unconsumed_tail or not inflater.eof:
        raise DecodeError(f"zlib stream longer than the {limit} bytes it may hold, or truncated")
    return out


def encode_dense(new: torch.Tensor) -> EncodedBucket:
    """The whole bucket, raw: what a full push sends (a view of ``new``'s memory, not a copy)."""
    return EncodedBucket(Positions.ALL, Values.RAW, False, False, new.numel(), 0, memoryview(new.numpy()).cast("B"))


def encode_bucket(old: torch.Tensor, new: torch.Tensor, changed: np.ndarray | None = None) -> EncodedBucket:
    """The smallest lossless encoding of ``old -> new`` (1-D CPU integer bit views of equal length);
    ``changed``: ``old != new`` if the caller has it already."""
    return min(candidate_encodings(old, new, changed), key=lambda c: c.nbytes)


def candidate_encodings(old: torch.Tensor, new: torch.Tensor, changed: np.ndarray | None = None) -> list[EncodedBucket]:
    """Every encoding `encode_bucket` weighs: the dense bucket (zlib'd if that pays); positions (gaps or
    bitmask, whichever ends up smaller) + values (raw or differences, likewise) unless at least 7/8 of
    the elements changed; and, when at least 3/4 changed, a difference for every element. An unchanged
    bucket has one, empty, encoding. Streams are built `CHUNK` elements at a time, bounding the int64
    temporaries."""
    n = new.numel()
    old_np, new_np = old.numpy(), new.numpy()
    changed_mask = old_np != new_np if changed is None else changed
    k = int(np.count_nonzero(changed_mask))
    if k == 0:
        return [EncodedBucket(Positions.GAPS, Values.DIFF, False, False, 0, 0, b"")]
    dense_values, dense_zipped = _smaller_stream(memoryview(new_np).cast("B"))
    candidates = [EncodedBucket(Positions.ALL, Values.RAW, False, dense_zipped, k, 0, dense_values)]
    # Which candidates are worth building (each costs a pass over the bucket): measured on GRPO deltas,
    # positions + values won up to at least 56% changed elements, differences for all at fp32's ~100%.
    if 4 * k >= 3 * n:  # most elements moved: a difference for every element, no positions
        all_diffs, zipped = _smaller_stream(diff_varints(new_np, old_np))
        candidates.append(EncodedBucket(Positions.ALL, Values.DIFF, False, zipped, k, 0, all_diffs))
    if 8 * k >= 7 * n:  # positions would carry next to nothing
        return candidates
    gaps, diffs, raws, previous = [], [], [], -1
    for s in range(0, n, CHUNK):
        local = np.flatnonzero(changed_mask[s : s + CHUNK])
        if local.size:
            gaps.append(varint_encode(np.diff(local + s, prepend=previous) - 1))
            previous = int(local[-1]) + s
            changed_new, changed_old = new_np[s : s + CHUNK][local], old_np[s : s + CHUNK][local]
            diffs.append(diff_varints(changed_new, changed_old))
            raws.append(changed_new.tobytes())
    values = _best_stream([(b"".join(diffs), Values.DIFF), (b"".join(raws), Values.RAW)])
    bitmask = np.packbits(changed_mask, bitorder="little").tobytes()
    positions = _best_stream([(b"".join(gaps), Positions.GAPS), (bitmask, Positions.BITMASK)])
    candidates.append(EncodedBucket(positions[2], values[2], positions[1], values[1], k, len(positions[0]),
                                    positions[0] + values[0]))
    return candidates


def decode_bucket(current: torch.Tensor, enc: EncodedBucket, in_place: bool = False) -> torch.Tensor:
    """The bucket after applying ``enc`` to ``current`` (a 1-D CPU integer bit view), written into
    ``current`` itself when ``in_place`` (it is then partly updated if decoding fails)."""
    n = current.numel()
    width = current.element_size()
    np_dtype = NUMPY_INT[current.dtype]
    if enc.positions_nbytes > enc.nbytes:
        raise DecodeError(f"positions stream of {enc.positions_nbytes} bytes in a {enc.nbytes}-byte payload")
    pos_data, val_data = enc.payload[: enc.positions_nbytes], enc.payload[enc.positions_nbytes :]
    if enc.positions_zlib:
        pos_data = _inflate(pos_data, 10 * n + 16)
    if enc.values_zlib:
        val_data = _inflate(val_data, 10 * n + 16)
    out = current.numpy() if in_place else current.numpy().copy()
    if enc.positions == Positions.ALL:
        idx = None
    elif enc.positions == Positions.GAPS:
        if not 0 <= enc.changed <= n:
            raise DecodeError(f"{enc.changed} changed elements in a bucket of {n}")
        idx = np.empty(enc.changed, dtype=np.int64)
        start, previous = 0, -1
        for gaps in varint_chunks(pos_data, enc.changed):
            positions = previous + np.cumsum(gaps.astype(np.int64) + 1)
            idx[start : start + gaps.size] = positions
            start, previous = start + gaps.size, int(positions[-1])
        if idx.size and (idx[-1] >= n or previous >= n):
            raise DecodeError(f"changed position {idx[-1]} outside a bucket of {n} elements")
    elif enc.positions == Positions.BITMASK:
        if len(pos_data) != (n + 7) // 8:
            raise DecodeError(f"bitmask of {len(pos_data)} bytes for a bucket of {n} elements")
        idx = np.flatnonzero(np.unpackbits(np.frombuffer(pos_data, dtype=np.uint8), count=n, bitorder="little"))
    else:
        raise DecodeError(f"unknown positions kind {enc.positions}")
    count = n if idx is None else idx.size
    if enc.values == Values.RAW:
        if len(val_data) != count * width:
            raise DecodeError(f"{len(val_data)} value bytes for {count} elements of {width} bytes")
        new_values = np.frombuffer(val_data, dtype=np_dtype)
    elif enc.values == Values.DIFF:
        if idx is None:
            apply_diff_varints(out, val_data, out=out)
            return torch.from_numpy(out)
        new_values = apply_diff_varints(out[idx], val_data)
    else:
        raise DecodeError(f"unknown values kind {enc.values}")
    if idx is None:
        out[:] = new_values
    else:
        out[idx] = new_values
    return torch.from_numpy(out)


# -------------------------------------------------------------------------------------------- checksum
CHECKSUM_CHUNK = 1 << 18  # elements per pass: 1-2 MiB of integer buffer, which stays in cache
CHECKSUM_COLS = 1 << 12  # a pass is viewed as rows of this many elements (a divisor of CHECKSUM_CHUNK)
# The buffer a pass is widened into: wide enough that every row and column sum below is exact (int16:
# |x| <= 2^15, a row of 2^12 sums to < 2^27, a column of 2^6 to < 2^21; int32 needs int64).
_WIDEN = {torch.int16: torch.int32, torch.int32: torch.int64}


class _ChecksumBuffers(threading.local):
    """Per-thread buffers (the sender's background thread and the trainer may checksum at once)."""

    def __init__(self):
        self.widened: dict[torch.dtype, torch.Tensor] = {}
        self.row_index = torch.arange(CHECKSUM_CHUNK // CHECKSUM_COLS, dtype=torch.int64)
        self.col_index = torch.arange(CHECKSUM_COLS, dtype=torch.int64)

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.widened:
            self.widened[dtype] = torch.empty(CHECKSUM_CHUNK, dtype=dtype)
        return self.widened[dtype]


_buffers = _ChecksumBuffers()


def bucket_checksum(bits: torch.Tensor, offset: int = 0) -> int:
    """``sum(bits_i * (2 * (offset + i) + 1))`` over int64 with wrap-around: one odd weight per position.

    An odd weight is invertible modulo 2^64, so a single changed element (any bit pattern, any position)
    always changes the sum; a swap of two unequal elements at i != j changes it by 2 (a - b)(i - j), which
    vanishes only if that is a multiple of 2^64. Sums over pieces add up (``offset`` = where a piece starts
    in its bucket), so a receiver checks what it holds without gathering the bucket first.

    Computed as ``(2 offset + 1) S0 + 2 S1`` with ``S0 = sum(x_i)`` and ``S1 = sum(i x_i)`` (the value of
    `bucket_checksum_reference`, bit for bit). ``S1`` of a pass of ``R`` rows by ``C`` columns is
    ``C sum_r r rowsum_r + sum_c c colsum_c``: two integer reductions over the pass (no per-element
    multiply, no int64 copy of bf16 bits) and two dot products of a few thousand elements. Every torch
    partial sum is exact (the bounds at `_WIDEN`; the dots stay below 2^62 for int32 bits), and the passes
    are combined in Python integers, so nothing here relies on int64 overflow; only the final value is
    wrapped to int64. Bit views other than int16 / int32 take the reference's way.
    """
    flat = bits.reshape(-1)
    widen = _WIDEN.get(flat.dtype)
    if widen is None:
        return bucket_checksum_reference(bits, offset)
    n, cols = flat.numel(), CHECKSUM_COLS
    buffer, row_index, col_index = _buffers.buffer(widen), _buffers.row_index, _buffers.col_index
    s0 = s1 = 0
    for start in range(0, n, CHECKSUM_CHUNK):
        size = min(CHECKSUM_CHUNK, n - start)
        chunk = buffer[:size]
        chunk.copy_(flat[start : start + size])  # widened (and brought to the CPU) on the way
        rows = size // cols
        if rows:
            grid = chunk[: rows * cols].view(rows, cols)
            row_sums = grid.sum(dim=1, dtype=widen).to(torch.int64)
            col_sums = grid.sum(dim=0, dtype=widen).to(torch.int64)
            rows_total = int(row_sums.sum())
            s0 += rows_total
            s1 += (start * rows_total + cols * int(torch.dot(row_sums, row_index[:rows]))
                   + int(torch.dot(col_sums, col_index)))
        tail = size - rows * cols
        if tail:  # fewer than `cols` elements: one dot with their indices
            rest = chunk[rows * cols :].to(torch.int64)
            tail_start = start + rows * cols
            tail_total = int(rest.sum())
            s0 += tail_total
            s1 += tail_start * tail_total + int(torch.dot(rest, col_index[:tail]))
    return _wrap64((2 * offset + 1) * s0 + 2 * s1)


def bucket_checksum_reference(bits: torch.Tensor, offset: int = 0) -> int:
    """`bucket_checksum` as first written, the definition the fast way is tested against (and what other
    integer views use): each chunk widened to int64 and multiplied by its odd weights, wrapping in int64."""
    flat = bits.reshape(-1)
    total = torch.zeros((), dtype=torch.int64)
    for start in range(0, flat.numel(), CHECKSUM_CHUNK):
        chunk = flat[start : start + CHECKSUM_CHUNK].to(device="cpu", dtype=torch.int64)
        first = 2 * (offset + start) + 1
        total += (chunk * torch.arange(first, first + 2 * chunk.numel(), 2, dtype=torch.int64)).sum()
    return _wrap64(int(total))


def _wrap64(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def combine_checksums(parts: list[int]) -> int:
    """The checksum of a bucket from the checksums of its pieces (each taken at its bucket offset)."""
    return _wrap64(sum(parts))
