"""LEB128 varints and zigzag-coded bit-pattern differences, vectorised with numpy and bounded in memory.

Weight-sync deltas spend most of their bytes on two integer streams: gaps between changed positions and
differences of bit patterns. Both are mostly small, so each value is written in as few 7-bit groups as
it needs. The wide (int64) arithmetic runs over at most `CHUNK` values at a time, so the temporaries
stay a few MiB whatever the bucket size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

CHUNK = 1 << 18  # values per pass of the int64 arithmetic (~10 MiB of temporaries at most)


class DecodeError(ValueError):
    """Bytes that do not decode to what the header promised."""


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128: 7 bits per byte, high bit set on every byte but a value's last. ``values`` >= 0."""
    v = np.ascontiguousarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    if v.size > CHUNK:
        return b"".join(varint_encode(v[s : s + CHUNK]) for s in range(0, v.size, CHUNK))
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


def _decode_complete(raw: np.ndarray) -> np.ndarray:
    """Varints from bytes that end exactly at a value's last byte."""
    last = raw < 0x80
    count = int(np.count_nonzero(last))
    if count == raw.size:
        return raw.astype(np.uint64)  # all one-byte values
    starts = np.concatenate(([0], np.flatnonzero(last)[:-1] + 1))
    value_of_byte = np.repeat(np.arange(count), np.diff(np.append(starts, raw.size)))
    position = np.arange(raw.size) - starts[value_of_byte]
    if position.max() > 9:
        raise DecodeError("a varint longer than 10 bytes")
    parts = (raw & np.uint8(0x7F)).astype(np.uint64) << (7 * position).astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts)


def varint_chunks(data: bytes, count: int) -> Iterator[np.ndarray]:
    """Exactly ``count`` varints from ``data`` (nothing left over), as uint64 arrays of up to ~`CHUNK`."""
    raw = np.frombuffer(data, dtype=np.uint8)
    pos = decoded = 0
    while pos < raw.size:
        window = raw[pos : pos + CHUNK]
        lasts = np.flatnonzero(window < 0x80)
        if lasts.size == 0:
            raise DecodeError("varint stream ends inside a value")
        stop = pos + int(lasts[-1]) + 1
        values = _decode_complete(raw[pos:stop])
        decoded += values.size
        if decoded > count:
            raise DecodeError(f"more than the {count} varints expected")
        yield values
        pos = stop
    if decoded != count:
        raise DecodeError(f"expected {count} varints in {raw.size} bytes, found {decoded}")


def varint_decode(data: bytes, count: int) -> np.ndarray:
    """Exactly ``count`` varints from ``data`` as one uint64 array."""
    chunks = list(varint_chunks(data, count))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint64)


def diff_varints(new: np.ndarray, old: np.ndarray) -> bytes:
    """Zigzag varints of the wrapping differences ``new - old`` of two equal-width integer arrays."""
    return b"".join(varint_encode(zigzag(wrapping_diff(new[s : s + CHUNK], old[s : s + CHUNK])))
                    for s in range(0, new.size, CHUNK))


def apply_diff_varints(base: np.ndarray, data: bytes, out: np.ndarray | None = None) -> np.ndarray:
    """``base`` + the differences in ``data`` (one per element), wrapped to ``base``'s width; ``out`` may be
    ``base`` itself (each chunk is read before it is written)."""
    out = np.empty_like(base) if out is None else out
    start = 0
    for diffs in varint_chunks(data, base.size):
        stop = start + diffs.size
        out[start:stop] = (base[start:stop].astype(np.int64) + unzigzag(diffs)).astype(base.dtype)
        start = stop
    return out


def zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64)
    return ((d << 1) ^ (d >> 63)).astype(np.uint64)


def unzigzag(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64)
    return ((z >> np.uint64(1)).astype(np.int64)) ^ -((z & np.uint64(1)).astype(np.int64))


def wrapping_diff(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """new - old of the bit patterns, wrapped into the signed range of their width (so it always fits)."""
    bits = new.dtype.itemsize * 8
    d = new.astype(np.int64) - old.astype(np.int64)
    half = 1 << (bits - 1)
    return ((d + half) & ((1 << bits) - 1)) - half
