"""Sequence packing without padding: the rows of a padded batch concatenated into one row of real tokens.

`PackedBatch` keeps only the tokens ``attention_mask`` marks real, in row order, with positions
counted per sequence (as the padded path's ``cumsum(mask) - 1``), and a `PackedSequences` that tells the
attention where each sequence starts. Attention is block-diagonal and causal, by one of three kernels:

* ``flash_varlen``: flash-attention's ``flash_attn_varlen_func`` over ``cu_seqlens`` (GPU, fp16/bf16, when
  ``flash_attn`` is installed);
* ``sdpa_per_sequence``: SDPA (or the soft-capped path) on each sequence's slice, causal, no mask: exactly
  the work of the real tokens, one small kernel per sequence and layer (the CPU default: measured faster
  than the block mask on the packing benchmark, docs/performance.md);
* ``sdpa_block_mask``: one SDPA over the whole row with a boolean ``[1, 1, N, N]`` mask built from per-token
  sequence ids (same sequence and key <= query), which computes every cross-sequence score and masks it.

What the model returns for a packed row depends on how the batch was built:

* with ``response_tokens`` (``[B, R]`` bool, the response tokens whose predictions the caller reads: the
  losses' and log-prob passes' mask), the outputs at the positions that predict those tokens only,
  ``[1, M, ...]`` in row-major order: the final norm, the head and the caller's log-softmax then run on the
  M real response tokens, and the caller puts its per-token results (no vocabulary dimension) back into the
  ``[B, R]`` layout with `response_layout`. The trainer's update, log-prob and value passes build it so;
* without, the outputs unpacked (`PackedBatch.unpack`) into the padded ``[B, keep, ...]`` layout, zeros on
  padding (the head runs on the real tokens among the kept ones; the layout is padded width).
"""

from __future__ import annotations

import torch

PACKED_KERNELS = ("flash_varlen", "sdpa_per_sequence", "sdpa_block_mask")


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_packed_kernel(device: torch.device | str) -> str:
    """The attention kernel for packed rows on ``device``: flash-attention's varlen kernel on a GPU that has
    it, else SDPA per sequence (the trainer logs the choice at start)."""
    if torch.device(device).type == "cuda" and flash_attn_available():
        return "flash_varlen"
    return "sdpa_per_sequence"


class PackedSequences:
    """Where each sequence of a packed row starts: ``cu_seqlens`` (int32 ``[S + 1]``), the lengths as ints,
    the longest, the per-token sequence ids ``[N]``, and the kernel the attention runs.

    A plain class rather than a dataclass: DDP and FSDP walk dataclass inputs and rebuild them."""

    def __init__(self, lengths: torch.Tensor, kernel: str):
        if kernel not in PACKED_KERNELS:
            raise ValueError(f"unknown packed attention kernel {kernel!r}; choose from {PACKED_KERNELS}")
        device = lengths.device
        self.kernel = kernel
        self.lengths = [int(n) for n in lengths.tolist()]
        self.max_len = max(self.lengths, default=0)
        self.cu_seqlens = torch.zeros(len(self.lengths) + 1, dtype=torch.int32, device=device)
        self.cu_seqlens[1:] = lengths.cumsum(0)
        total = int(self.cu_seqlens[-1])
        self.sequence_ids = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), lengths,
                                                    output_size=total)
        self._masks: dict[int | None, torch.Tensor] = {}

    def block_mask(self, window: int | None) -> torch.Tensor:
        """``[1, 1, N, N]`` True where query and key are in one sequence and the key is not after the query
        (and, with a sliding ``window``, less than ``window`` tokens behind it: ``key > query - window``)."""
        if window not in self._masks:
            ids = self.sequence_ids
            pos = torch.arange(ids.shape[0], device=ids.device)
            allowed = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])
            if window is not None:
                allowed &= pos[None, :] > pos[:, None] - window
            self._masks[window] = allowed[None, None]
        return self._masks[window]


class PackedBatch:
    """A padded batch's rows packed into one: ``input_ids`` and ``position_ids`` ``[1, N]`` (N real tokens),
    ``sequences`` for the attention, and ``token_index`` ``[B, T]``: each padded slot's place in the packed
    row (N for padding, which reads a zero row when unpacking).

    Pass it as the model's ``attention_mask`` with ``input_ids=packed.input_ids``; the model then returns
    outputs in the padded layout (``[B, logits_to_keep or T, ...]``), or, with ``response_tokens`` ``[B, R]``
    (the last R columns of the batch are its responses), only the outputs predicting the marked response
    tokens, ``[1, M, ...]`` (module docstring)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kernel: str = "sdpa_per_sequence",
                 response_tokens: torch.Tensor | None = None):
        real = attention_mask.bool()
        self.input_ids = input_ids[real].unsqueeze(0)
        self.position_ids = ((attention_mask.long().cumsum(-1) - 1)[real]).unsqueeze(0)
        self.sequences = PackedSequences(real.sum(-1), kernel)
        total = self.input_ids.shape[1]
        index = real.flatten().long().cumsum(0).view(real.shape) - 1
        self.token_index = torch.where(real, index, torch.full_like(index, total))
        self.padded_shape = tuple(real.shape)
        self.response_positions = None  # packed positions predicting the marked response tokens, [M]
        if response_tokens is not None:
            width, columns = response_tokens.shape[1], real.shape[1]
            # The output at column c predicts the token at c + 1: response token t sits at T - R + t.
            predicting = self.token_index[:, columns - width - 1 : columns - 1][response_tokens.bool()]
            if bool((predicting == total).any()):  # one sync per micro-batch, as the lengths above
                raise ValueError("response_tokens marks a response token whose preceding position is padding "
                                 "(an empty prompt?): nothing predicts it in the packed row")
            self.response_positions = predicting

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def kept_tokens(self, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed positions whose outputs the last ``keep`` padded columns need (all for 0), ascending
        ``[M]``, and the flat ``[B * keep]`` slots they go to (the same order: both are row-major). The
        model's final norm and head then run on those M real tokens only. Built with ``response_tokens``: the
        positions predicting them (``keep`` is then the response width + 1 or 0) and no slots."""
        if self.response_positions is not None:
            return self.response_positions, None
        index = self.token_index[:, -keep:] if keep else self.token_index
        real = index.flatten() < self.num_tokens
        return index.flatten()[real], real.nonzero().squeeze(1)

    def unpack(self, kept: torch.Tensor, slots: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """``kept`` ``[1, M, ...]`` (outputs at `kept_tokens`' positions) into the padded ``[B, keep, ...]``
        layout, zeros on padding. A copy into place, whose gradient is a gather (a scatter-add backward
        over a vocabulary-wide row is many times slower on CPU). Built with ``response_tokens``: ``kept``
        itself, the packed layout the caller reads."""
        if self.response_positions is not None:
            return kept
        rows = self.padded_shape[0]
        width = keep or self.padded_shape[1]
        out = kept.new_zeros((rows * width, *kept.shape[2:])).index_copy(0, slots, kept[0])
        return out.view(rows, width, *kept.shape[2:])


def response_layout(values: torch.Tensor, response_tokens: torch.Tensor) -> torch.Tensor:
    """Per-token results ``[M, ...]`` of the marked response tokens (row-major, as a `PackedBatch` built with
    ``response_tokens`` returns them) into the ``[B, R, ...]`` layout, zeros elsewhere. Differentiable; no
    vocabulary dimension is ever unpacked."""
    marked = response_tokens.bool()
    out = values.new_zeros((*marked.shape, *values.shape[1:]))
    return out.masked_scatter(marked.view(*marked.shape, *(1,) * (values.dim() - 1)), values)


def packed_batch_or_none(input_ids: torch.Tensor, attention_mask: torch.Tensor, kernel: str | None,
                         response_tokens: torch.Tensor | None = None):
    """``(input_ids, attention_mask)`` to call a model with: the packed row and its `PackedBatch` when
    ``kernel`` names one (outputs in the packed layout of ``response_tokens`` when given), else the padded
    pair unchanged."""
    if kernel is None:
        return input_ids, attention_mask
    packed = PackedBatch(input_ids, attention_mask, kernel, response_tokens)
    return packed.input_ids, packed
