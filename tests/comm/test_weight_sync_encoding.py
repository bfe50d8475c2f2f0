"""Delta encoding of weight buckets (exact round trips, the smallest encoding chosen), the bucket checksum,
and the bucket plan's cuts."""

import itertools
import threading

import numpy as np
import pytest
import torch

from scalerl.comm.weights.delta import (
    CHECKSUM_CHUNK,
    CHECKSUM_COLS,
    DecodeError,
    EncodedBucket,
    Positions,
    Values,
    bucket_checksum,
    bucket_checksum_reference,
    candidate_encodings,
    combine_checksums,
    decode_bucket,
    encode_bucket,
    encode_dense,
)
from scalerl.comm.weights.plan import WeightPlan
from scalerl.comm.weights.varints import CHUNK, varint_decode, varint_encode


def _bits(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    view = torch.int16 if dtype.itemsize == 2 else torch.int32
    return values.to(dtype).reshape(-1).view(view).clone()


def test_varints_round_trip_every_width():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**32 - 1, 2**63, 2**64 - 1], dtype=np.uint64)
    data = varint_encode(values)
    assert len(varint_encode(np.array([127], dtype=np.uint64))) == 1
    assert len(varint_encode(np.array([128], dtype=np.uint64))) == 2
    assert np.array_equal(varint_decode(data, len(values)), values)
    with pytest.raises(DecodeError):
        varint_decode(data, len(values) - 1)  # bytes left over
    with pytest.raises(DecodeError):
        varint_decode(data[:-1], len(values))  # truncated


def _cases(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20_000, generator=g) * 0.05
    one_ulp = lambda x: x + x.abs() * 2.0 ** -7 * (torch.rand(x.shape, generator=g) < 1)
    sparse = w.clone()
    pick = torch.randperm(w.numel(), generator=g)[:200]
    sparse[pick] = one_ulp(w[pick])
    return {
        "sparse": (w, sparse),
        "dense_small_steps": (w, w + 1e-6 * torch.randn(w.shape, generator=g)),
        # new bit patterns drawn at random (incompressible): nothing beats sending them as they are
        "random_new": (w, torch.randint(-2**15, 2**15, w.shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
                       if dtype == torch.bfloat16 else torch.randint(-2**31, 2**31, w.shape, generator=g).int().view(torch.float32)),
        "unchanged": (w, w.clone()),
        "half_changed": (w, torch.where(torch.rand(w.shape, generator=g) < 0.5, one_ulp(w), w)),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_candidate_round_trips_exactly_and_the_smallest_is_chosen(dtype):
    for name, (before, after) in _cases(dtype).items():
        old, new = _bits(before, dtype), _bits(after, dtype)
        candidates = candidate_encodings(old, new)
        for enc in candidates:
            assert torch.equal(decode_bucket(old, enc), new), (name, enc.name)
        chosen = encode_bucket(old, new)
        assert chosen.nbytes == min(c.nbytes for c in candidates), name
        assert chosen.nbytes <= new.numel() * new.element_size(), name  # never worse than the dense bucket
        assert chosen.changed == int((old != new).sum()), name


def test_each_encoding_is_chosen_where_it_is_smallest():
    """Sparse one-ulp steps -> gaps + differences; most bf16 elements one ulp apart -> a difference per
    element; fp32 weights all nudged -> differences for all; new random values -> the dense bucket; sparse
    random jumps -> raw values; about half of the elements changed at random -> a bitmask."""
    bf16, fp32 = _cases(torch.bfloat16), _cases(torch.float32)
    chosen = lambda cases, key, dtype: encode_bucket(*(_bits(t, dtype) for t in cases[key]))
    sparse = chosen(bf16, "sparse", torch.bfloat16)
    assert (sparse.positions, sparse.values) == (Positions.GAPS, Values.DIFF)
    assert chosen(fp32, "dense_small_steps", torch.float32).positions == Positions.ALL
    assert chosen(fp32, "dense_small_steps", torch.float32).values == Values.DIFF
    assert chosen(bf16, "random_new", torch.bfloat16).name == "all+raw"
    assert chosen(bf16, "unchanged", torch.bfloat16).name == "unchanged"
    assert chosen(bf16, "unchanged", torch.bfloat16).nbytes == 0
    assert chosen(bf16, "half_changed", torch.bfloat16).positions == Positions.BITMASK
    g = torch.Generator().manual_seed(1)
    old = torch.randint(-2**15, 2**15, (20_000,), dtype=torch.int16, generator=g)
    new = old.clone()
    pick = torch.randperm(old.numel(), generator=g)[:100]
    new[pick] = torch.randint(-2**15, 2**15, (100,), dtype=torch.int16, generator=g)
    jumps = encode_bucket(old, new)
    assert (jumps.positions, jumps.values) == (Positions.GAPS, Values.RAW)


def test_one_ulp_sparse_delta_is_far_smaller_than_the_dense_bucket():
    before, after = _cases(torch.bfloat16)["sparse"]  # 1% of elements one ulp apart
    old, new = _bits(before, torch.bfloat16), _bits(after, torch.bfloat16)
    assert encode_bucket(old, new).nbytes < 0.02 * new.numel() * 2


def test_corrupt_payloads_are_refused_not_applied():
    before, after = _cases(torch.bfloat16)["sparse"]
    old, new = _bits(before, torch.bfloat16), _bits(after, torch.bfloat16)
    enc = encode_bucket(old, new)
    bad = EncodedBucket(enc.positions, enc.values, enc.positions_zlib, enc.values_zlib, enc.changed + 1,
                        enc.positions_nbytes, enc.payload)
    with pytest.raises(DecodeError):
        decode_bucket(old, bad)
    truncated = EncodedBucket(enc.positions, enc.values, enc.positions_zlib, enc.values_zlib, enc.changed,
                              enc.positions_nbytes, enc.payload[:-3])
    with pytest.raises(DecodeError):
        decode_bucket(old, truncated)
    short_dense = encode_dense(new[:-1])
    with pytest.raises(DecodeError):
        decode_bucket(old, short_dense)
    import zlib

    bomb = zlib.compress(b"\x00" * (100 * old.numel()))  # inflates far past anything a bucket may hold
    with pytest.raises(DecodeError):
        decode_bucket(old, EncodedBucket(Positions.ALL, Values.DIFF, False, True, old.numel(), 0, bomb))


@pytest.mark.parametrize("view", [torch.int16, torch.int32])
def test_checksum_catches_any_single_changed_element(view):
    g = torch.Generator().manual_seed(2)
    info = torch.iinfo(view)
    bits = torch.randint(info.min, info.max, (3000,), dtype=view, generator=g)
    reference = bucket_checksum(bits)
    for position in range(bits.numel()):  # every position, one flipped bit each (cycling through the bits)
        flipped = bits.clone()
        flipped[position] ^= 1 << (position % (8 * bits.element_size() - 1))
        assert bucket_checksum(flipped) != reference, position
    for bit in range(8 * bits.element_size()):  # every bit of one element, the sign bit included
        flipped = bits.clone()
        flipped[7] = int(flipped[7]) ^ (1 << bit) if bit < 8 * bits.element_size() - 1 else -int(flipped[7]) - 1
        assert bucket_checksum(flipped) != reference, bit
    swapped = bits.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert bucket_checksum(swapped) != reference  # positions are weighted, so a swap shows too
    assert bucket_checksum(bits.clone()) == reference


# Sizes around every boundary of the fast checksum: a row, a pass, and a tail after whole passes and rows.
CHECKSUM_SIZES = [0, 1, 5, CHECKSUM_COLS - 1, CHECKSUM_COLS, CHECKSUM_COLS + 1, CHECKSUM_CHUNK - 1, CHECKSUM_CHUNK,
                  CHECKSUM_CHUNK + 1, 2 * CHECKSUM_CHUNK + 3 * CHECKSUM_COLS + 17]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_checksum_equals_the_reference_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    view = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(view)
    for n in CHECKSUM_SIZES:
        weights = _bits(torch.randn(n, generator=g) * 0.05, dtype)
        patterns = torch.randint(info.min, info.max + 1, (n,), dtype=torch.int64, generator=g).to(view)  # NaNs too
        for bits in (weights, patterns):
            for offset in (0, 1, 12345, 2**40 + 7):
                assert bucket_checksum(bits, offset) == bucket_checksum_reference(bits, offset), (n, offset)


@pytest.mark.parametrize("view", [torch.int16, torch.int32])
def test_fast_checksum_wraps_like_the_reference_at_the_extremes(view):
    """All-max / all-min bit patterns: the reference's int64 products and sums overflow and wrap many
    times over; the fast way must land on the same int64."""
    n = 3 * CHECKSUM_CHUNK + 5
    info = torch.iinfo(view)
    for fill in (info.max, info.min):
        bits = torch.full((n,), fill, dtype=view)
        for offset in (0, 2**40 + 7):
            assert bucket_checksum(bits, offset) == bucket_checksum_reference(bits, offset), (fill, offset)
    mixed = torch.where(torch.arange(n) % 3 == 0, info.max, info.min).to(view)
    assert bucket_checksum(mixed, 99) == bucket_checksum_reference(mixed, 99)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksums_of_pieces_combine_to_the_whole(dtype):
    g = torch.Generator().manual_seed(4)
    n = 2 * CHECKSUM_CHUNK + CHECKSUM_COLS + 3
    bits = _bits(torch.randn(n, generator=g), dtype)
    cuts = sorted(set(torch.randint(1, n, (7,), generator=g).tolist()) | {CHECKSUM_CHUNK, CHECKSUM_COLS - 1})
    edges = [0, *cuts, n]
    parts = [bucket_checksum(bits[a:b], a) for a, b in itertools.pairwise(edges)]
    whole = bucket_checksum_reference(bits)
    assert combine_checksums(parts) == bucket_checksum(bits) == whole
    assert combine_checksums(parts[:-1]) != whole  # a missing piece shows


def test_fast_checksum_of_strided_and_2d_views():
    g = torch.Generator().manual_seed(5)
    grid = torch.randint(-(2**31), 2**31 - 1, (700, 900), dtype=torch.int32, generator=g)
    for bits in (grid, grid.t(), grid[:, ::3]):  # reshape(-1) copies the non-contiguous ones, in order
        assert bucket_checksum(bits, 11) == bucket_checksum_reference(bits, 11)


def test_fast_checksum_from_threads_at_once():
    """Its buffers are per thread: the sender's background push and the trainer's load may checksum at once."""
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randint(-(2**15), 2**15 - 1, (CHECKSUM_CHUNK + 999,), dtype=torch.int16, generator=g)
               for _ in range(4)]
    expected = [bucket_checksum_reference(t) for t in tensors]
    wrong = []

    def check(i):
        for _ in range(15):
            if bucket_checksum(tensors[i]) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=check, args=(i,)) for i in range(len(tensors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_plan_cuts_big_tensors_across_buckets_and_packs_tiny_ones():
    shapes = [("big", (10, 7))] + [(f"tiny{i}", (3,)) for i in range(10)] + [("last", (5,))]
    plan = WeightPlan(shapes, torch.bfloat16, bucket_elems=32)
    assert plan.total_elems == 70 + 30 + 5 and plan.num_buckets == 4
    covered = {name: [] for name, _ in shapes}
    for b in range(plan.num_buckets):
        lo, hi = plan.bucket_range(b)
        offset = 0
        for seg in plan.segments(b):
            assert seg.bucket_offset == offset  # segments tile the bucket in order
            offset += seg.numel
            covered[seg.entry.name].append((seg.tensor_start, seg.tensor_stop))
        assert offset == hi - lo
    assert covered["big"] == [(0, 32), (32, 64), (64, 70)]  # one tensor over three buckets
    assert len({b for b in range(plan.num_buckets) for s in plan.segments(b) if s.entry.name.startswith("tiny")}) == 2
    same = WeightPlan.from_json(plan.to_json())
    assert same.hash64() == plan.hash64() and same.to_json() == plan.to_json()
    assert WeightPlan(shapes, torch.float32, 32).hash64() != plan.hash64()
    for bad in ('{"dtype": "int8", "bucket_elems": 4, "tensors": []}',
                '{"dtype": "bfloat16", "bucket_elems": 4, "tensors": [["a", [-1]]]}', '[1, 2]'):
        with pytest.raises(ValueError):
            WeightPlan.from_json(bad)
    with pytest.raises(ValueError):
        WeightPlan([("a", (2,)), ("a", (3,))], torch.bfloat16, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_buckets_larger_than_the_arithmetic_chunk_round_trip(dtype):
    """Streams are built and decoded CHUNK elements at a time: gaps, differences and varints must carry
    across chunk boundaries (changes placed right at them)."""
    g = torch.Generator().manual_seed(3)
    n = 2 * CHUNK + 1234
    before = torch.randn(n, generator=g)
    for fraction in (0.001, 0.3, 1.0):
        after = before.clone()
        pick = torch.randperm(n, generator=g)[: int(n * fraction)]
        after[pick] += 0.05 * torch.randn(pick.numel(), generator=g)
        for edge in (CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, n - 1):
            after[edge] += 1.0
        old, new = _bits(before, dtype), _bits(after, dtype)
        for enc in candidate_encodings(old, new):
            assert torch.equal(decode_bucket(old, enc), new), (fraction, enc.name)
    big = np.arange(3 * CHUNK, dtype=np.uint64) * 977
    assert np.array_equal(varint_decode(varint_encode(big), big.size), big)
