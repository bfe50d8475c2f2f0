"""A preallocated key/value cache: one allocation per generation call, written in place each step."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for every layer, ``[layers, B, kv_heads, max_len, head_dim]``.

    For the fused decode path (``allocate`` then ``update_kv``) they are two views of one buffer ``kv``
    ``[layers, B, 2 kv_heads, max_len, head_dim]`` (keys in the first heads, values in the rest), so a layer's
    new keys and values go in with one copy and moving rows or columns is one copy per layer, not two. The
    model's own forward (``update``) gets two buffers, as its keys and values come apart.

    Preallocating avoids the ``torch.cat`` per layer per token that grows a cache quadratically in copies.
    The buffers are allocated at the first ``update``, from the keys the model actually produced: their
    head count is the rank's own under tensor parallelism (and full under FSDP, whose sharded weights say
    nothing about it). ``update`` writes the new positions and returns views of the filled prefix.

    A batch may shrink while decoding (``keep_rows``): the kept rows move to the front of the buffers and
    later updates, carrying fewer rows, use only that front part.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int):
        self.num_layers, self.batch_size, self.max_len = num_layers, batch_size, max_len
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        self._layer_kv: tuple[torch.Tensor, ...] = ()  # kv[layer], taken once (a step indexes no layer dim)

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The shared buffer and its key / value views (uninitialised: every read position is written first)."""
        shape = (self.num_layers, self.batch_size, 2 * kv_heads, self.max_len, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.keys, self.values = self.kv[:, :, :kv_heads], self.kv[:, :, kv_heads:]
        self._layer_kv = tuple(self.kv.unbind(0))

    def _allocate_separate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Two buffers shaped after ``k`` and ``v`` ``[B, heads, T, dim]``: the model's own forward writes keys
        and values apart (``update``), and torch.compile of that forward takes no aliasing key/value views."""
        shape = (self.num_layers, self.batch_size, k.shape[1], self.max_len, k.shape[3])
        self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
        shape = (self.num_layers, self.batch_size, v.shape[1], self.max_len, v.shape[3])
        self.values = torch.empty(shape, dtype=v.dtype, device=v.device)

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.kv,) if self.kv is not None else (self.keys, self.values)

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int) -> "KVCache":
        return cls(model.config.num_hidden_layers, batch_size, max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self._allocate_separate(k, v)
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to position {end} but the cache holds {self.max_len}")
        rows = k.shape[0]
        self.keys[layer, :rows, :, start:end] = k
        self.values[layer, :rows, :, start:end] = v
        return self.keys[layer, :rows, :, :end], self.values[layer, :rows, :, :end]

    def update_kv(self, layer: int, kv: torch.Tensor, start: int, view_start: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``kv`` ``[rows, 2 kv_heads, T, head_dim]`` (keys then values, the buffer's head order) at
        ``start`` in one copy; returns the layer's keys and values over columns ``[view_start, start + T)``."""
        end = start + kv.shape[2]
        if self.kv is None:
            raise ValueError("update_kv needs the shared key/value buffer: call allocate() first (this cache was "
                             "allocated by update(), the model's own forward)")
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to position {end} but the cache holds {self.max_len}")
        heads = kv.shape[1] // 2
        filled = self._layer_kv[layer][: kv.shape[0], :, view_start:end]  # few view ops: a step runs this per layer
        filled[:, :, start - view_start :] = kv
        return filled[:, :heads], filled[:, heads:]

    def keep_rows(self, keep: torch.Tensor, filled: int) -> None:
        """Shrink the batch to ``keep.numel()`` rows, new row ``i`` being current row ``keep[i]``. Only the
        rows that change place are copied, so a ``keep`` that leaves surviving rows where they are costs a
        copy per finished row, not per kept row."""
        moved = (keep != torch.arange(keep.numel(), device=keep.device)).nonzero().squeeze(1)
        if moved.numel():
            # Layer by layer: the temporary holds one layer's moved rows, not all layers' (GPU memory), and
            # on CPU gathering a 4-d slice along its first dim measured 3-4x faster than the 5-d one along dim 1.
            for layer in range(self.num_layers):
                for buffer in self._buffers():
                    filled_part = buffer[layer, :, :, :filled]
                    filled_part.index_copy_(0, moved, filled_part.index_select(0, keep[moved]))
        self.batch_size = keep.numel()


class SlotKVCache(KVCache):
    """A cache of ``slots`` rows that requests come and go in (continuous batching), ``[layers, slots,
    kv_heads, columns, head_dim]``.

    Every decoding row writes its newest token at the same column (``update``'s ``start``), so one decode
    step is one slice write, as in `KVCache`; a row's own length is given by its key mask, not its place: a
    request admitted mid-way has its prompt right-aligned to the current column, its older columns masked.
    ``view_start`` is the first column any live row uses, so attention reads only columns some row needs.
    The owner moves columns left (``move_columns``) when the write column reaches the end, and moves rows
    (``move_rows``) to close the gaps finished rows leave.
    """

    def __init__(self, num_layers: int, slots: int, columns: int):
        super().__init__(num_layers, slots, columns)
        self.view_start = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if self.keys is None or end > self.max_len:
            raise ValueError(f"slot KV cache: writing columns [{start}, {end}) of {self.max_len} (allocated: "
                             f"{self.keys is not None})")
        rows = k.shape[0]
        self.keys[layer, :rows, :, start:end] = k
        self.values[layer, :rows, :, start:end] = v
        return self.keys[layer, :rows, :, self.view_start:end], self.values[layer, :rows, :, self.view_start:end]

    def update_kv(self, layer: int, kv: torch.Tensor, start: int, view_start: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + kv.shape[2]
        if self.kv is None or end > self.max_len:
            raise ValueError(f"slot KV cache: writing columns [{start}, {end}) of {self.max_len} (allocated: "
                             f"{self.kv is not None})")
        return super().update_kv(layer, kv, start, self.view_start)

    def write_rows(self, slots: torch.Tensor, prefilled: KVCache, end: int) -> None:
        """Copy a prefill's cache (``[layers, k, heads, P, dim]``) into rows ``slots`` at columns ``[end - P, end)``."""
        keys, values = prefilled.keys, prefilled.values
        fresh = self.keys is None
        if fresh and prefilled.kv is not None:
            self.allocate(keys.shape[2], keys.shape[4], keys.dtype, keys.device)
        elif self.keys is None:
            self._allocate_separate(keys[0], values[0])
        if fresh:
            # Zeroed once: a row admitted mid-way masks the columns left of its prompt, but attention still
            # multiplies them (a masked score is its key's product plus -inf), so a NaN or inf that
            # uninitialised memory happened to hold there made that row's every later token NaN.
            for buffer in self._buffers():
                buffer.zero_()
        start = end - keys.shape[3]
        if self.kv is not None and prefilled.kv is not None:
            self.kv[:, slots, :, start:end] = prefilled.kv
        else:
            self.keys[:, slots, :, start:end] = keys
            self.values[:, slots, :, start:end] = values

    def move_columns(self, first: int, last: int, to: int, rows: int) -> None:
        """Columns ``[first, last)`` of the first ``rows`` rows to ``[to, to + last - first)`` (ranges may overlap)."""
        if self.keys is None or first == to:
            return
        for layer in range(self.num_layers):  # one layer's temporary at a time
            for buffer in self._buffers():
                buffer[layer, :rows, :, to : to + last - first] = buffer[layer, :rows, :, first:last].clone()

    def move_rows(self, source: torch.Tensor, target: torch.Tensor, first: int, last: int) -> None:
        """Rows ``source`` to rows ``target`` over columns ``[first, last)``."""
        if self.keys is None or not source.numel():
            return
        for layer in range(self.num_layers):
            for buffer in self._buffers():
                part = buffer[layer, :, :, first:last]
                part.index_copy_(0, target, part.index_select(0, source))
