"""A step's rollout parts as the trainer receives them (`scalerl.trainer.rl_step`; the whole batch is the
one-part case), and with ``rollout.stream_groups`` the per-token forward passes over a step's rows run part by part as the rollout workers' replies arrive, with the same results as one pass over
the whole batch.

Each standalone worker answers a contiguous set of whole prompt groups (`scalerl.rollout.sources.token_split`),
and the replies come in whatever order the workers finish. The passes (old log-probs, reference log-probs)
run on the whole batch's micro-batch grid: rows ``[k * m, (k + 1) * m)`` for micro-batch size ``m``, each
micro-batch as soon as all its rows are in (one that straddles two parts waits for both). A micro-batch's
rows are cut from their parts and trimmed of all-padding columns exactly as the whole-batch pass trims them
(`RolloutBatch.trimmed`), so the model sees the same tensors and the results are the same, bit for bit,
whatever the arrival order; `pass_results` puts them back into the whole batch's ``[B, R]`` layout.

With data parallelism each trainer rank keeps its own share of the step's rows (``share_starts``: where every
DP rank's share begins; its own at ``own_start``) and sees every part arrive, in the same order on every rank.
A micro-batch runs once its rows are in on every rank's share, so the ranks run their passes in lockstep (a
sharded forward is a collective) without a message of their own: each decides from the same arrivals.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.engine import GenerationOutput

# A pass over one micro-batch: its per-token results [m, R_micro] or [m, R_micro, C] (zero on padding).
MicroPass = Callable[[RolloutBatch], torch.Tensor]


class StreamedStep:
    """A step's parts as they arrive (``add``) and the passes run on the micro-batches they complete."""

    def __init__(self, total_rows: int, micro_batch_size: int, passes: dict[str, MicroPass], pad_token_id: int,
                 share_starts: tuple[int, ...] = (0,), own_start: int = 0):
        self.total_rows, self.micro, self.passes, self.pad_token_id = total_rows, micro_batch_size, passes, pad_token_id
        self.share_starts, self.own_start = share_starts, own_start
        self.parts: dict[int, GenerationOutput] = {}  # first row (of this share) -> its rows' output
        self.arrived = torch.zeros(total_rows, dtype=torch.bool)  # this share's rows
        self.arrived_anywhere = torch.zeros(max(share_starts) + total_rows, dtype=torch.bool)  # the step's rows
        self.pending = list(range(0, total_rows, micro_batch_size)) if passes else []  # micro-batches not run
        self.results: dict[str, dict[int, torch.Tensor]] = {name: {} for name in passes}  # name -> start -> [m, R]

    def add(self, start: int, out: GenerationOutput, last: bool = False) -> None:
        """The step's rows ``start .. start + len(out)`` arrived (this share's among them are kept): every pass
        on each micro-batch now whole on every share. After the part marked ``last`` every share's rows are
        in (a colocated rank sees only its own share's one part)."""
        stop = start + len(out.finish_reasons)
        self.arrived_anywhere[start:stop] = True
        if last:
            self.arrived_anywhere[:] = True
        lo, hi = max(start, self.own_start), min(stop, self.own_start + self.total_rows)
        if lo < hi:
            self.parts[lo - self.own_start] = out.rows(lo - start, hi - start) if (lo, hi) != (start, stop) else out
            self.arrived[lo - self.own_start : hi - self.own_start] = True
        for first in [s for s in self.pending if self._everywhere(s, s + self.micro)]:
            self.pending.remove(first)
            rows = self._rows(first, min(first + self.micro, self.total_rows))
            batch = RolloutBatch.from_generation(rows, torch.zeros(len(rows.finish_reasons), dtype=torch.long),
                                                 torch.zeros(len(rows.finish_reasons)))
            for name, run in self.passes.items():
                self.results[name][first] = run(batch)

    def output(self) -> GenerationOutput:
        """The whole step's output, its parts in row order (what the unstreamed source hands over)."""
        if not bool(self.arrived.all()):
            raise RuntimeError(f"streamed step has {int(self.arrived.sum())} of {self.total_rows} rows")
        if len(self.parts) == 1:  # the one-part case (a colocated rank, a whole batch): as it came
            return self.parts[0]
        return GenerationOutput.concat([self.parts[s] for s in sorted(self.parts)], self.pad_token_id)

    def pass_results(self, response_width: int) -> dict[str, torch.Tensor]:
        """Each pass's per-token results over the whole batch, ``[B, response_width]``, zero on padding."""
        if self.pending:
            raise RuntimeError(f"streamed step has micro-batches {self.pending} not run")
        out = {}
        for name, by_start in self.results.items():
            first = next(iter(by_start.values()))
            full = first.new_zeros(self.total_rows, response_width, *first.shape[2:])
            for start, values in by_start.items():
                full[start : start + values.shape[0], : values.shape[1]] = values
            out[name] = full
        return out

    def ready(self, start: int, stop: int) -> bool:
        """Whether this share's rows ``start .. stop`` are in on every share and every pass ran on the
        micro-batches that hold them (so every DP rank decides alike)."""
        first = start // self.micro * self.micro
        return self._everywhere(start, stop) and not any(first <= s < stop for s in self.pending)

    def _everywhere(self, start: int, stop: int) -> bool:
        """Whether rows ``start .. stop`` of every DP rank's share are in."""
        stop = min(stop, self.total_rows)
        return all(bool(self.arrived_anywhere[q + start : q + stop].all()) for q in self.share_starts)

    def rows_with_passes(self, start: int, stop: int) -> tuple[GenerationOutput, dict[str, torch.Tensor]]:
        """Rows ``start .. stop`` (`ready`) and each pass's results on them, ``[rows, their response width]``
        (a micro-batch's columns past it are padding for these rows: zero)."""
        out = self._rows(start, stop)
        width, results = out.response_ids.shape[1], {}
        for name, by_start in self.results.items():
            first = next(iter(by_start.values()))
            part = torch.zeros(stop - start, width, *first.shape[2:], dtype=first.dtype, device=first.device)
            for micro_start, values in by_start.items():
                lo, hi = max(start, micro_start), min(stop, micro_start + values.shape[0])
                if lo < hi:
                    cols = min(width, values.shape[1])
                    part[lo - start : hi - start, :cols] = values[lo - micro_start : hi - micro_start, :cols]
            results[name] = part
        return out, results

    def _rows(self, start: int, stop: int) -> GenerationOutput:
        """Rows ``start .. stop`` of the step, cut from the parts that hold them."""
        pieces = []
        for first, part in sorted(self.parts.items()):
            last = first + len(part.finish_reasons)
            lo, hi = max(start, first), min(stop, last)
            if lo < hi:
                pieces.append(part.rows(lo - first, hi - first))
        return GenerationOutput.concat(pieces, self.pad_token_id)
