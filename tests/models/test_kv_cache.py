"""The slot cache of continuous batching: one shared write column, a view from the first live column,
prefills copied into chosen rows, columns and rows moved."""

import pytest
import torch

from scalerl.models.kv_cache import KVCache, SlotKVCache

LAYERS, HEADS, DIM = 2, 2, 3


def _prefill(rows: int, width: int, offset: float) -> KVCache:
    cache = KVCache(LAYERS, rows, width)
    for layer in range(LAYERS):
        k = torch.arange(rows * HEADS * width * DIM, dtype=torch.float32).view(rows, HEADS, width, DIM) + offset + layer
        cache.update(layer, k, -k, 0)
    return cache


def test_prefills_land_in_their_rows_right_aligned_to_the_column():
    cache = SlotKVCache(LAYERS, 4, 10)
    first = _prefill(2, 3, 0.0)
    cache.write_rows(torch.tensor([2, 0]), first, end=5)
    assert torch.equal(cache.keys[:, 2, :, 2:5], first.keys[:, 0])
    assert torch.equal(cache.keys[:, 0, :, 2:5], first.keys[:, 1])
    assert torch.equal(cache.values[:, 0, :, 2:5], -first.keys[:, 1])


def test_decode_writes_one_column_and_views_from_the_first_live_one():
    cache = SlotKVCache(LAYERS, 4, 10)
    cache.write_rows(torch.tensor([0, 1, 2]), _prefill(3, 3, 0.0), end=5)
    cache.view_start = 2
    k = torch.full((3, HEADS, 1, DIM), 7.0)
    keys, values = cache.update(1, k, -k, 5)
    assert keys.shape == (3, HEADS, 4, DIM)  # columns 2..5 of the rows in use
    assert torch.equal(keys[:, :, -1:], k) and torch.equal(values[:, :, -1:], -k)
    assert torch.equal(keys[:, :, :3], cache.keys[1, :3, :, 2:5])


def test_columns_move_with_overlap_and_rows_move_to_gaps():
    cache = SlotKVCache(LAYERS, 3, 8)
    cache.write_rows(torch.tensor([0, 1, 2]), _prefill(3, 5, 0.0), end=8)
    before = cache.keys.clone()
    cache.move_columns(3, 8, 1, rows=3)  # [3, 8) -> [1, 6): overlapping ranges
    assert torch.equal(cache.keys[:, :, :, 1:6], before[:, :, :, 3:8])
    moved = cache.keys.clone()
    cache.move_rows(torch.tensor([2]), torch.tensor([0]), 1, 6)
    assert torch.equal(cache.keys[:, 0, :, 1:6], moved[:, 2, :, 1:6])
    assert torch.equal(cache.keys[:, 1], moved[:, 1])


def test_keys_and_values_share_one_buffer_written_with_one_copy():
    cache = KVCache(LAYERS, 2, 6)
    cache.allocate(HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.kv.copy_(torch.arange(cache.kv.numel(), dtype=torch.float32).view_as(cache.kv))
    kv = torch.randn(2, 2 * HEADS, 3, DIM)
    keys, values = cache.update_kv(1, kv, 2)
    assert keys.shape == values.shape == (2, HEADS, 5, DIM)
    assert torch.equal(cache.keys[1, :, :, 2:5], kv[:, :HEADS]) and torch.equal(cache.values[1, :, :, 2:5], kv[:, HEADS:])
    assert keys.data_ptr() == cache.kv[1].data_ptr()  # views of the one buffer, no copy
    slots = SlotKVCache(LAYERS, 3, 8)
    slots.write_rows(torch.tensor([2, 0]), cache, end=8)  # the whole buffer, keys and values at once
    assert torch.equal(slots.values[:, 2, :, 2:8], cache.values[:, 0]) and torch.equal(slots.keys[:, 0, :, 2:8], cache.keys[:, 1])
    with pytest.raises(ValueError, match="KV cache overflow"):
        cache.update_kv(0, kv, 4)
