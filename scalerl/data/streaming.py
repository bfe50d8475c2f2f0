"""Training rows streamed from Parquet or Arrow files of any size (``data.streaming=true``): read lazily, row
group by row group, each data-parallel rank reading only its own share, shuffled within a bounded window.

The share: the rows of all files (in the order `expand_paths` gives them, then row groups) are numbered
0..N-1 from the files' footers alone; of R data-parallel ranks, rank r reads rows [r*S, (r+1)*S) with
S = N // R, and only the row groups overlapping that range (its TP/PP peers read the same). The shares
are disjoint and equal, and cover all rows but the last N mod R (fewer than R; `DistContext.dp_share`
drops a batch's remainder the same way). Every batch takes batch_size / R rows from each share, so all
ranks draw the same number of rows per step and their epochs (S rows each) end together; `next_batch`
gathers the shares, in rank order, into the step's whole batch (what `PromptStream.next_batch` returns),
which the trainer's `dp_share` cuts back into each rank's own rows.

The order of an epoch: the share's pieces (row groups, or the parts of the two row groups at the share's
ends) in an order seeded by (seed, epoch, rank), their rows cut into windows of ``shuffle_buffer`` rows, and
each window shuffled (seeded by the same and the window's index). One window of converted rows is held at
a time, plus the Arrow data of one row group, so memory depends on ``data.shuffle_buffer`` and the files'
row-group size, not on the dataset. With ``shuffle=False`` the rows come in file order (the window still
bounds what is held). Epochs restart the stream.

State: ``{"position": rows drawn by all ranks together}``, `PromptStream`'s key and meaning. A window is a
function of (seed, epoch, rank, window index) alone, so a resumed stream reads only its current window
again and gives exactly the rows an uninterrupted one would; resumed under another number of ranks it goes
on from the same number of rows, but the shares (and so the rows) differ.

Rows are converted as the whole-file loader converts them (`scalerl.data.loaders.record_converter` and
`table_records`): the same format detection, row contract, and errors naming the file, the 1-based row in
the file and the field; a bad row stops the run when the stream reaches it. JSON lines are refused (a rank
cannot find its share without reading the whole file): convert them to Parquet once.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalerl.data.errors import DataError
from scalerl.data.formats import ColumnNames
from scalerl.data.loaders import (
    ARROW_SUFFIXES,
    JSON_LINES_SUFFIXES,
    PARQUET_SUFFIXES,
    empty_data_files,
    record_converter,
    table_records,
)

STREAMED_SUFFIXES = PARQUET_SUFFIXES + ARROW_SUFFIXES


class ParquetPieces:
    """A Parquet file's columns and row groups, read one row group at a time."""

    def __init__(self, path: Path):
        import pyarrow.parquet

        self.path = path
        try:
            metadata = pyarrow.parquet.read_metadata(path)
        except Exception as error:  # pyarrow.ArrowInvalid and friends
            raise DataError(f"{path}: cannot be read as Parquet: {error}") from error
        self.columns = set(metadata.schema.to_arrow_schema().names)
        self.lengths = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self._file: Any = None  # opened on the first read

    def read(self, index: int) -> Any:
        import pyarrow.parquet

        if self._file is None:
            self._file = pyarrow.parquet.ParquetFile(self.path)
        return self._file.read_row_group(index)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ArrowPieces:
    """An Arrow IPC file or stream (what `datasets` writes) and its record batches, memory-mapped: a batch
    is read when it is converted, the ones before it are only skipped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            reader = self._open()
            self.columns = set(reader.schema.names)
            self.lengths = [batch.num_rows for batch in self._batches(reader)]
        except Exception as error:
            raise DataError(f"{path}: cannot be read as Arrow IPC (stream or file): {error}") from error

    def _open(self) -> Any:
        import pyarrow
        import pyarrow.ipc

        source = pyarrow.memory_map(str(self.path))
        try:
            return pyarrow.ipc.open_stream(source)
        except pyarrow.ArrowInvalid:
            source.seek(0)
            return pyarrow.ipc.open_file(source)

    @staticmethod
    def _batches(reader: Any):
        if hasattr(reader, "num_record_batches"):  # the IPC file format: random access
            return (reader.get_batch(i) for i in range(reader.num_record_batches))
        return iter(reader)

    def read(self, index: int) -> Any:
        import pyarrow

        reader = self._open()
        if hasattr(reader, "num_record_batches"):
            return pyarrow.Table.from_batches([reader.get_batch(index)])
        for position, batch in enumerate(reader):
            if position == index:
                return pyarrow.Table.from_batches([batch])
        raise DataError(f"{self.path}: record batch {index} is gone; was the file changed during the run?")

    def close(self) -> None:
        pass


def open_pieces(path: Path) -> ParquetPieces | ArrowPieces:
    """The reader for a streamed file; a kind that cannot be streamed is an error naming the file and the fix."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return ParquetPieces(path)
    if suffix in ARROW_SUFFIXES:
        return ArrowPieces(path)
    if suffix in JSON_LINES_SUFFIXES:
        target = path.with_suffix(".parquet")
        raise DataError(
            f"{path}: data.streaming=true reads Parquet and Arrow files by row group, and JSON lines cannot be "
            "split into ranks' shares without reading them whole; convert it once, e.g. python -c \"import "
            f"pyarrow.json, pyarrow.parquet; pyarrow.parquet.write_table(pyarrow.json.read_json('{path}'), "
            f"'{target}', row_group_size=1000)\", and list the .parquet file, or set data.streaming=false")
    raise DataError(f"{path}: data.streaming=true streams Parquet ({', '.join(PARQUET_SUFFIXES)}) and Arrow "
                    f"({', '.join(ARROW_SUFFIXES)}) files, not {suffix or 'files without a suffix'!r}; convert it "
                    "to Parquet, or set data.streaming=false")


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one row group (or record batch) of file ``file``, whose first row is row
    ``first_row`` (0-based) of that file."""

    file: int
    index: int
    first_row: int
    start: int
    stop: int


class StreamingPromptStream:
    """`PromptStream`'s interface (``next_batch``, ``state_dict``, ``load_state_dict``) over files read
    lazily: this rank reads its share only (see the module's docstring). ``gather`` turns this rank's part
    of a batch into the whole batch (every rank's part, in rank order); with one rank it is not needed."""

    def __init__(self, paths: Sequence[Path], batch_size: int, seed: int, *, shuffle: bool = True,
                 shuffle_buffer: int = 10_000, rank: int = 0, ranks: int = 1,
                 gather: Callable[[list[dict]], list[dict]] | None = None, kind: str = "auto",
                 prompt_template: str | None = None, columns: ColumnNames | None = None,
                 prefer: str | None = None, batch_key: str = "trainer.batch_size"):
        if shuffle_buffer < 1:
            raise DataError(f"data.shuffle_buffer={shuffle_buffer} must be >= 1 (rows held for shuffling)")
        if batch_size % ranks:
            raise DataError(f"{batch_key}={batch_size} must divide over the {ranks} data-parallel ranks")
        if ranks > 1 and gather is None:
            raise DataError("a stream over several data-parallel ranks needs `gather` to assemble each batch")
        self.paths = [Path(p) for p in paths]
        self.files = [open_pieces(path) for path in self.paths]
        self.batch_size, self.seed, self.shuffle, self.window_rows = batch_size, seed, shuffle, shuffle_buffer
        self.rank, self.ranks, self.gather = rank, ranks, gather or (lambda share: share)
        self._convert_args = (kind, prompt_template, columns or ColumnNames(), prefer)
        self._converters: dict[int, Callable[[int, dict], dict]] = {}
        total = sum(sum(f.lengths) for f in self.files)
        if not total:
            raise empty_data_files(self.paths)
        self.share_rows, self.rows_per_batch = total // ranks, batch_size // ranks
        if self.rows_per_batch > self.share_rows:
            raise DataError(f"{batch_key}={batch_size} exceeds the {self.share_rows * ranks} training rows its "
                            f"{ranks} data-parallel rank(s) share; lower {batch_key} or give more data "
                            "(data.train_files)")
        self.pieces = self._share_pieces(rank * self.share_rows, (rank + 1) * self.share_rows)
        self.position = 0  # rows this rank has drawn, across epochs
        self.converted_rows = 0  # rows read and converted so far (what the window bound limits)
        self._window_key: tuple[int, int] | None = None
        self._window: list[dict] = []
        self._cached: tuple[int, int, Any] | None = None  # the last row group read: (file, index, table)
        self._epoch_order: tuple[int, list[Piece], list[int]] | None = None

    def _share_pieces(self, lo: int, hi: int) -> list[Piece]:
        """The pieces holding global rows [lo, hi): the row groups overlapping them, cut at the ends."""
        pieces, offset = [], 0
        for file_index, pieces_file in enumerate(self.files):
            first_row = 0
            for index, length in enumerate(pieces_file.lengths):
                start, stop = max(lo - offset, 0), min(hi - offset, length)
                if start < stop:
                    pieces.append(Piece(file_index, index, first_row, start, stop))
                offset, first_row = offset + length, first_row + length
        return pieces

    def _order(self, epoch: int) -> tuple[list[Piece], list[int]]:
        """The epoch's pieces in order, and where each starts in the epoch (kept for the epoch)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(self.pieces)
            if self.shuffle:
                random.Random(f"stream:{self.seed}:{epoch}:{self.rank}").shuffle(order)
            starts = list(itertools.accumulate((p.stop - p.start for p in order[:-1]), initial=0))
            self._epoch_order = (epoch, order, starts)
        return self._epoch_order[1], self._epoch_order[2]

    def _load_window(self, epoch: int, window: int) -> list[dict]:
        """Rows [window * W, (window + 1) * W) of the epoch's order (W = shuffle_buffer), shuffled."""
        if self._window_key == (epoch, window):
            return self._window
        self._window, self._window_key = [], None  # the old window goes before the new one is read
        lo, hi = window * self.window_rows, min((window + 1) * self.window_rows, self.share_rows)
        order, starts = self._order(epoch)
        rows = []
        for position in range(bisect.bisect_right(starts, lo) - 1, len(order)):
            piece, offset = order[position], starts[position]
            if offset >= hi:
                break
            length = piece.stop - piece.start
            start = piece.start + max(lo - offset, 0)
            rows.extend(self._read(piece, start, piece.start + min(hi - offset, length)))
        if self.shuffle:
            random.Random(f"stream:{self.seed}:{epoch}:{self.rank}:{window}").shuffle(rows)
        self._window, self._window_key = rows, (epoch, window)
        return rows

    def _read(self, piece: Piece, start: int, stop: int) -> list[dict]:
        """Rows [start, stop) of a piece's row group, converted; each error names the row in its file."""
        if self._cached is None or self._cached[:2] != (piece.file, piece.index):
            if self._cached is not None and self._cached[0] != piece.file:
                self.files[self._cached[0]].close()  # one file open at a time, however many there are
            self._cached = None
            self._cached = (piece.file, piece.index, self.files[piece.file].read(piece.index))
        source = self.files[piece.file]
        first = piece.first_row + start + 1  # 1-based row in the file
        records = table_records(source.path, self._cached[2].slice(start, stop - start), first_row=first)
        convert = self._converter(piece.file)
        self.converted_rows += len(records)
        return [convert(first + i, record) for i, record in enumerate(records)]

    def _converter(self, file_index: int) -> Callable[[int, dict], dict]:
        if file_index not in self._converters:
            kind, template, names, prefer = self._convert_args
            source = self.files[file_index]
            self._converters[file_index] = record_converter(source.path, source.columns, kind, template,
                                                            names=names, prefer=prefer)
        return self._converters[file_index]

    @property
    def held_rows(self) -> int:
        """Converted rows held now: the current window's (at most ``shuffle_buffer``)."""
        return len(self._window)

    def next_share(self) -> list[dict]:
        """This rank's part of the next batch: batch_size / ranks rows of its share."""
        share: list[dict] = []
        while len(share) < self.rows_per_batch:
            epoch, offset = divmod(self.position, self.share_rows)
            window, within = divmod(offset, self.window_rows)
            rows = self._load_window(epoch, window)
            take = min(self.rows_per_batch - len(share), len(rows) - within)
            share.extend(rows[within : within + take])
            self.position += take
        return share

    def next_batch(self) -> list[dict]:
        """The next whole batch: every rank's part, in rank order (a collective with several ranks)."""
        return self.gather(self.next_share())

    def state_dict(self) -> dict:
        return {"position": self.position * self.ranks}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"]) // self.ranks

    def close(self) -> None:
        for source in self.files:
            source.close()
        self._cached, self._window, self._window_key = None, [], None
