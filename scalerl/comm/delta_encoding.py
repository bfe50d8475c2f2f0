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
included. Measured on the demo's GRPO updates the mix matters: see docs/weight-sync.md.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

ZLIB_LEVEL = 6  # on GRPO deltas here: 10-30% smaller streams than level 1; level 9 gained under 1% more
MIN_COMPRESS_BYTES = 64  # shorter streams are not worth a zlib header
# zlib level 6 ran at ~10-15 MB/s on barely compressible streams on this (shared, 2-core) CPU, slower than
# the 25 MB/s of a 200 Mbit link: a large stream is compressed only when a level-1 probe of its first
# PROBE_BYTES saves at least MIN_SAVING (fp32 differences probed at ~12% and saved 9%: not worth 50+ ms).
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


class DecodeError(ValueError):
    """An encoded bucket that does not decode to the expected number of elements."""


@dataclass
class EncodedBucket:
    """One bucket's change. ``payload`` = positions stream (``positions_nbytes`` bytes) + values stream."""

    positions: Positions
    values: Values
    positions_zlib: bool
    values_zlib: bool
    changed: int  # elements whose bit pattern changed (all of them for a dense push)
    positions_nbytes: int
    payload: bytes

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


# ------------------------------------------------------------------------------------------------ varints
def varint_encode(values: np.ndarray) -> bytes:
    """LEB128: 7 bits per byte, high bit set on every byte but a value's last. ``values`` >= 0."""
    v = np.ascontiguousarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    lengths = np.ones(v.size, dtype=np.uint8)
    largest = int(v.max())
    width = 1
    while width < 10 and largest >= 1 << (7 * width):
        lengths += v >= np.uint64(1 << (7 * width))
        width += 1
    if width == 1:
        return v.astype(np.uint8).tobytes()  # every value < 128: one byte each, as is
    # Row i holds value i's `width` candidate bytes; the mask keeps its first lengths[i] (row-major order).
    table = np.empty((v.size, width), dtype=np.uint8)
    for j in range(width):
        table[:, j] = ((v >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        table[:, j] |= (lengths > j + 1).astype(np.uint8) << 7
    return table[np.arange(width) < lengths[:, None]].tobytes()


def varint_decode(data: bytes, count: int) -> np.ndarray:
    """Exactly ``count`` varints from ``data`` (nothing left over) as uint64."""
    raw = np.frombuffer(data, dtype=np.uint8)
    last = raw < 0x80  # the last byte of each value
    found = int(np.count_nonzero(last))
    if found != count or (count and not last[-1]) or (not count and raw.size):
        raise DecodeError(f"expected {count} varints in {raw.size} bytes, found {found}")
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    if found == raw.size:
        return raw.astype(np.uint64)  # all one-byte values
    starts = np.concatenate(([0], np.flatnonzero(last)[:-1] + 1))
    value_of_byte = np.repeat(np.arange(count), np.diff(np.append(starts, raw.size)))
    position = np.arange(raw.size) - starts[value_of_byte]
    if position.max() > 9:
        raise DecodeError("a varint longer than 10 bytes")
    parts = (raw & np.uint8(0x7F)).astype(np.uint64) << (7 * position).astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts)


def _zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64)
    return ((d << 1) ^ (d >> 63)).astype(np.uint64)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64)
    return ((z >> np.uint64(1)).astype(np.int64)) ^ -((z & np.uint64(1)).astype(np.int64))


def _wrapping_diff(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """new - old of the bit patterns, wrapped into the signed range of their width (so it always fits)."""
    bits = new.dtype.itemsize * 8
    d = new.astype(np.int64) - old.astype(np.int64)
    half = 1 << (bits - 1)
    return ((d + half) & ((1 << bits) - 1)) - half


# --------------------------------------------------------------------------------------------- streams
def _smaller_stream(data: bytes) -> tuple[bytes, bool]:
    """``data`` or its zlib compression, whichever is shorter, and whether it is compressed."""
    if len(data) < MIN_COMPRESS_BYTES:
        return data, False
    if len(data) > 2 * PROBE_BYTES and len(zlib.compress(data[:PROBE_BYTES], 1)) > (1 - MIN_SAVING) * PROBE_BYTES:
        return data, False
    packed = zlib.compress(data, ZLIB_LEVEL)
    return (packed, True) if len(packed) < len(data) else (data, False)


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
    """The whole bucket, raw: what a full push sends."""
    data = new.numpy().tobytes()
    return EncodedBucket(Positions.ALL, Values.RAW, False, False, new.numel(), 0, data)


def encode_bucket(old: torch.Tensor, new: torch.Tensor) -> EncodedBucket:
    """The smallest lossless encoding of ``old -> new`` (1-D CPU integer bit views of equal length)."""
    return min(candidate_encodings(old, new), key=lambda c: c.nbytes)


def candidate_encodings(old: torch.Tensor, new: torch.Tensor) -> list[EncodedBucket]:
    """Every encoding `encode_bucket` weighs: the dense bucket (zlib'd if that is smaller); positions (gaps or bitmask, whichever is
    smaller) + values (raw or differences, whichever is smaller); and, when at least 1/8 of the elements
    changed, a difference for every element. An unchanged bucket has one, empty, encoding."""
    n = new.numel()
    old_np, new_np = old.numpy(), new.numpy()
    changed_mask = old_np != new_np
    idx = np.flatnonzero(changed_mask)
    k = idx.size
    if k == 0:
        return [EncodedBucket(Positions.GAPS, Values.DIFF, False, False, 0, 0, b"")]
    dense_values, dense_zipped = _smaller_stream(new_np.tobytes())
    dense = EncodedBucket(Positions.ALL, Values.RAW, False, dense_zipped, k, 0, dense_values)
    if k == n:  # every element changed: positions carry nothing
        all_diffs, zipped = _smaller_stream(varint_encode(_zigzag(_wrapping_diff(new_np, old_np))))
        return [dense, EncodedBucket(Positions.ALL, Values.DIFF, False, zipped, k, 0, all_diffs)]
    new_changed = new_np[idx]
    diffs = varint_encode(_zigzag(_wrapping_diff(new_changed, old_np[idx])))
    values = min(
        [(*_smaller_stream(diffs), Values.DIFF), (*_smaller_stream(new_changed.tobytes()), Values.RAW)],
        key=lambda c: len(c[0]),
    )
    gaps = varint_encode(np.diff(idx, prepend=-1) - 1)
    bitmask = np.packbits(changed_mask, bitorder="little").tobytes()
    positions = min([(*_smaller_stream(gaps), Positions.GAPS), (*_smaller_stream(bitmask), Positions.BITMASK)],
                    key=lambda c: len(c[0]))
    candidates = [dense, EncodedBucket(positions[2], values[2], positions[1], values[1], k, len(positions[0]),
                                       positions[0] + values[0])]
    if k * 8 >= n:  # most elements moved (e.g. fp32 weights): a difference for every element, no positions
        all_diffs, zipped = _smaller_stream(varint_encode(_zigzag(_wrapping_diff(new_np, old_np))))
        candidates.append(EncodedBucket(Positions.ALL, Values.DIFF, False, zipped, k, 0, all_diffs))
    return candidates


def decode_bucket(current: torch.Tensor, enc: EncodedBucket) -> torch.Tensor:
    """The bucket after applying ``enc`` to ``current`` (a 1-D CPU integer bit view; not modified)."""
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
    out = current.numpy().copy()
    if enc.positions == Positions.ALL:
        idx = None
    elif enc.positions == Positions.GAPS:
        if not 0 <= enc.changed <= n:
            raise DecodeError(f"{enc.changed} changed elements in a bucket of {n}")
        idx = np.cumsum(varint_decode(pos_data, enc.changed).astype(np.int64) + 1) - 1
        if idx.size and idx[-1] >= n:
            raise DecodeError(f"changed position {idx[-1]} outside a bucket of {n} elements")
    elif enc.positions == Positions.BITMASK:
        if len(pos_data) != (n + 7) // 8:
            raise DecodeError(f"bitmask of {len(pos_data)} bytes for a bucket of {n} elements")
        bits = np.unpackbits(np.frombuffer(pos_data, dtype=np.uint8), count=n, bitorder="little")
        idx = np.flatnonzero(bits)
    else:
        raise DecodeError(f"unknown positions kind {enc.positions}")
    count = n if idx is None else idx.size
    if enc.values == Values.RAW:
        if len(val_data) != count * width:
            raise DecodeError(f"{len(val_data)} value bytes for {count} elements of {width} bytes")
        new_values = np.frombuffer(val_data, dtype=np_dtype)
    elif enc.values == Values.DIFF:
        base = out if idx is None else out[idx]
        diffs = _unzigzag(varint_decode(val_data, count))
        new_values = (base.astype(np.int64) + diffs).astype(np_dtype)  # wraps like the encoder's difference
    else:
        raise DecodeError(f"unknown values kind {enc.values}")
    if idx is None:
        out[:] = new_values
    else:
        out[idx] = new_values
    return torch.from_numpy(out)


# -------------------------------------------------------------------------------------------- checksum
CHECKSUM_CHUNK = 1 << 20
_MULT = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant (golden ratio), as a signed int64


def bucket_checksum(bits: torch.Tensor) -> int:
    """``sum(bits_i * (2 * (i * M) + 1))`` over int64 with wrap-around: one weight per position.

    Every weight is odd, so invertible modulo 2^64: a single changed element (any bit pattern, any
    position) always changes the sum, and a swap of two unequal elements changes it unless their weight
    difference happens to annihilate it. Computed in chunks to bound the temporary int64 memory.
    """
    flat = bits.reshape(-1)
    total = torch.zeros((), dtype=torch.int64)
    for start in range(0, flat.numel(), CHECKSUM_CHUNK):
        chunk = flat[start : start + CHECKSUM_CHUNK].to(device="cpu", dtype=torch.int64)
        pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64)
        weights = (pos * _MULT) * 2 + 1
        total += (chunk * weights).sum()
    return int(total)
