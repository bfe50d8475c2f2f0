"""Read data files (JSON lines, Parquet, Arrow, Hugging Face `save_to_disk` directories) into rows.

Every row is a dict; what a reward and the trainer may read from it (the row contract):

    "prompt"        str, or chat messages [{"role", "content"}, ...] (roles system/user/assistant/tool,
                    text content). Text is encoded as it is (BOS first; with `data.chat_template=true` as
                    one user message); messages always go through the tokenizer's chat template, with the
                    generation prompt appended (`scalerl.data.prompts`).
    "ground_truth"  what rule rewards compare against: str for gsm8k, math and rows files (and the built-in
                    task); for verl rows, and TRL rows with a ground truth, the value as written (text in
                    verl's own scripts; numbers, lists and dicts reach custom reward functions unchanged).
                    Every format has it except TRL rows, which have it when `data.ground_truth_key` names
                    a column or the dataset has a "ground_truth" column.
    "response"      str, optional: a reference answer (SFT trains on it); TRL's "completion".
  verl rows also carry, under verl's names, what verl's reward managers hand to `compute_score`:
    "data_source"   the `data.reward_fn_key` column (default "data_source"): str, or None when absent
    "ability"       str or None
    "reward_model"  dict ({"style", "ground_truth"}) or None
    "extra_info"    dict; {} when absent or null, as verl's RLHFDataset makes it
  verl and TRL rows also carry:
    "columns"       dict: every column of the record except the prompt (and TRL's "completion"), as
                    read. TRL's GRPOTrainer passes exactly these to `reward_fn(prompts, completions,
                    **columns)`; `scalerl.data.formats.reward_columns(row)` gives them for any row.
  rows-format files keep every field of the record top-level, as written.

The formats and their columns are `scalerl.data.formats`. `kind` (`data.format`) is one of `KINDS`;
"auto" tells it per file from the columns, trying `prefer` (the task's own format, `data.task=gsm8k` or
`math`) first. `prompt_template` is a `str.format` template with one field, `{question}`, for gsm8k and
math files; the default, `DEFAULT_PROMPT_TEMPLATE`, is "Question: {question}\\nAnswer:".

Files are read with `pyarrow` (a core dependency; `datasets` is not needed to read): `.jsonl`/`.json`/
`.ndjson` as JSON lines, `.parquet`, `.arrow` (the Arrow IPC stream `datasets` writes, or an Arrow IPC
file). A path may be a file, a glob pattern, or a directory: one written by `Dataset.save_to_disk`
(its `state.json` lists its shards), one written by `DatasetDict.save_to_disk` (`split` picks the split,
`data.split` / `data.val_split`), or any other directory (all such files in it, sorted). Nothing is
downloaded: a Hub name is an error saying how to get a local copy. Any bad row raises `DataError` naming
the file, the 1-based row number (blank lines are not counted) and the field.
"""

from __future__ import annotations

import glob
import json
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scalerl.data.errors import DataError
from scalerl.data.formats import (
    CONVERTERS,
    FORMATS,
    OWN_PROMPT_FORMATS,
    ColumnNames,
    RowContext,
    detect_format,
)

DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
KINDS = FORMATS
JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
DATA_SUFFIXES = JSON_LINES_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES


def load_rows(
    path_or_paths: str | Path | Sequence[str | Path],
    kind: str = "auto",
    prompt_template: str | None = None,
    limit: int | None = None,
    *,
    columns: ColumnNames | None = None,
    split: str = "train",
    prefer: str | None = None,
) -> list[dict]:
    """All rows of the given files (in order), converted to the row format; at most `limit` of them."""
    if kind not in KINDS:
        raise DataError(f"data kind {kind!r} is not one of {KINDS}")
    template = DEFAULT_PROMPT_TEMPLATE if prompt_template is None else prompt_template
    _check_template(template)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit={limit!r} must be a non-negative integer or None")
    names = columns or ColumnNames()
    rows: list[dict] = []
    for path in expand_paths(path_or_paths, split):
        file_columns, records = _read_records(path)
        if not records:  # no format to tell (the caller says when no file has a row)
            continue
        convert = record_converter(path, file_columns, kind, prompt_template, names=names, prefer=prefer)
        for number, record in enumerate(records, start=1):
            if limit is not None and len(rows) >= limit:
                return rows
            rows.append(convert(number, record))
    return rows


def record_converter(path: Path, file_columns: set[str], kind: str = "auto", prompt_template: str | None = None,
                     *, names: ColumnNames | None = None, prefer: str | None = None) -> Callable[[int, dict], dict]:
    """``convert(number, record) -> row`` for the records of `path`, whose columns are `file_columns`: the
    format told from them (`kind` "auto") or `kind`; `number` is the record's 1-based row in the file, which
    its errors name. The whole-file loader and the streamed one (`scalerl.data.streaming`) both convert here."""
    names = names or ColumnNames()
    template = DEFAULT_PROMPT_TEMPLATE if prompt_template is None else prompt_template
    file_kind = kind if kind != "auto" else detect_format(path, file_columns, names, prefer)
    if file_kind in OWN_PROMPT_FORMATS and prompt_template is not None:  # such rows keep their own prompt
        raise DataError(f"{path}: its rows already hold a {names.prompt!r} field ({file_kind} format), so "
                        f"data.prompt_template={template!r} would be ignored; remove data.prompt_template, or "
                        "give question/answer rows")
    convert = CONVERTERS[file_kind]
    return lambda number, record: convert(RowContext(path, number, record), template, names)


def _read_records(path: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """The file's column names and its records as dicts, read with pyarrow."""
    suffix = path.suffix.lower()
    try:
        if suffix in JSON_LINES_SUFFIXES:
            import pyarrow.json

            table = pyarrow.json.read_json(path)
        elif suffix in PARQUET_SUFFIXES:
            import pyarrow.parquet

            table = pyarrow.parquet.read_table(path)
        elif suffix in ARROW_SUFFIXES:
            table = _read_arrow(path)
        else:
            raise DataError(
                f"{path}: unsupported file type {suffix!r}; use JSON lines ({', '.join(JSON_LINES_SUFFIXES)}), "
                f"Parquet ({', '.join(PARQUET_SUFFIXES)}) or Arrow ({', '.join(ARROW_SUFFIXES)})"
            )
    except DataError:
        raise
    except Exception as error:  # pyarrow.ArrowInvalid and friends; pyarrow counts rows from 0
        if suffix in JSON_LINES_SUFFIXES:
            return _read_json_lines(path)
        expected = ("JSON lines (one object per line)" if suffix in JSON_LINES_SUFFIXES
                    else "Parquet" if suffix in PARQUET_SUFFIXES else "Arrow IPC (stream or file)")
        raise DataError(f"{path}: cannot be read as {expected} (pyarrow counts rows from 0): {error}") from error
    return set(table.column_names), table_records(path, table)


def table_records(path: Path, table: Any, first_row: int = 1) -> list[dict[str, Any]]:
    """The records of `table` (a pyarrow table read from `path`, its first row being row `first_row` of the
    file) as dicts; text that is not UTF-8 raises `DataError` naming the file's row and the field."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError as error:  # pyarrow reads the bytes unchecked and fails only when converting
        raise DataError(f"{path}{_first_non_utf8(table, first_row - 1)}: text is not UTF-8 ({error.reason}); "
                        "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_json_lines(path: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """JSON lines that pyarrow refuses, read line by line: pyarrow wants one type per column, JSON lets a
    field's type vary by row, so such a file reads here and a wrong type is named by its row and field.
    Missing fields become None, as pyarrow makes them."""
    records, number = [], 0
    with open(path, "rb") as lines:
        for line in lines:
            if not line.strip():
                continue
            number += 1
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as error:
                raise DataError(f"{path}, row {number}: text is not UTF-8 ({error.reason}); convert the file to "
                                "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            except json.JSONDecodeError as error:
                raise DataError(f"{path}, row {number}: cannot be read as JSON lines (one object per line): "
                                f"{error}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}, row {number}: cannot be read as JSON lines (one object per line): it "
                                f"is a {type(record).__name__}, not an object")
            records.append(record)
    columns = list(dict.fromkeys(key for record in records for key in record))
    return set(columns), [{key: record.get(key) for key in columns} for record in records]


def _read_arrow(path: Path) -> Any:
    """An Arrow IPC stream (what `datasets` writes) or an Arrow IPC file."""
    import pyarrow
    import pyarrow.ipc

    with pyarrow.memory_map(str(path)) as source:
        try:
            return pyarrow.ipc.open_stream(source).read_all()
        except pyarrow.ArrowInvalid:
            source.seek(0)
            return pyarrow.ipc.open_file(source).read_all()


def _first_non_utf8(table: Any, rows_before: int = 0) -> str:
    """", row N, field 'F'" for the first value that is not UTF-8 (rows 1-based, counted from the file's
    start: the table begins after `rows_before` rows of it)."""
    for name in table.column_names:
        column = table.column(name)
        try:
            column.to_pylist()
            continue
        except UnicodeDecodeError:
            pass
        good, bad = 0, len(column)  # rows [0, good) convert; rows [0, bad) do not
        while bad - good > 1:
            middle = (good + bad) // 2
            try:
                column.slice(0, middle).to_pylist()
                good = middle
            except UnicodeDecodeError:
                bad = middle
        return f", row {rows_before + bad}, field {name!r}"
    return ""


def empty_data_files(paths: Sequence[Path], key: str = "data.train_files") -> DataError:
    """The error for the files of `key` (data.train_files or data.val_files) without a single row, naming
    each file read (a directory's or a pattern's too) and the fix."""
    training = key == "data.train_files"
    return DataError(f"the {'training' if training else 'evaluation'} set is empty: no rows in {key} "
                     f"({', '.join(map(str, paths))}); put rows in them (JSON lines: one JSON object per line; "
                     f"Parquet or Arrow: at least one row) or point {key} at the right files"
                     + ("" if training else f", or remove {key} to skip evaluation"))


def expand_paths(path_or_paths: str | Path | Sequence[str | Path], split: str = "train") -> list[Path]:
    """The data files named by files, glob patterns and directories (a saved dataset's shards, the `split` of
    a DatasetDict), in order."""
    entries = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    if not entries:
        raise DataError("no data files given")
    paths: list[Path] = []
    for entry in entries:
        entry = Path(entry)
        if entry.is_dir():
            paths.extend(_directory_files(entry, split))
        elif entry.is_file():
            paths.append(entry)
        elif glob.has_magic(str(entry)):
            found = sorted(Path(match) for match in glob.glob(str(entry)))
            if not found:
                raise DataError(f"pattern {str(entry)!r} matches no files")
            paths.extend(found)
        else:
            raise DataError(f"data file {str(entry)!r} does not exist (relative to {Path.cwd()}){_hub_hint(entry)}")
    return paths


def _directory_files(directory: Path, split: str) -> list[Path]:
    """A `save_to_disk` directory's shards (the `split` of a DatasetDict), or every data file in it."""
    if (directory / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one Dataset directory per split
        splits = _read_json(directory / "dataset_dict.json").get("splits")
        if not isinstance(splits, list):
            raise DataError(f"{directory / 'dataset_dict.json'} has no 'splits' list; was it written by "
                            "DatasetDict.save_to_disk?")
        if split not in splits:
            raise DataError(f"{directory} is a DatasetDict with splits {splits}, not {split!r}; set data.split "
                            "(data.val_split for data.val_files) to one of them")
        return _directory_files(directory / split, split)
    if (directory / "state.json").is_file():  # Dataset.save_to_disk: state.json lists the Arrow shards in order
        shards = _read_json(directory / "state.json").get("_data_files")
        if not isinstance(shards, list) or not all(isinstance(s, dict) and "filename" in s for s in shards):
            raise DataError(f"{directory / 'state.json'} has no '_data_files' list of {{'filename'}}; was it "
                            "written by Dataset.save_to_disk?")
        files = [directory / shard["filename"] for shard in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DataError(f"{directory} is a saved dataset whose shards {missing} are missing; save it again")
        return files
    found = sorted(p for p in directory.iterdir() if p.suffix.lower() in DATA_SUFFIXES)
    if not found:
        raise DataError(f"directory {directory} holds no {', '.join(DATA_SUFFIXES)} files, and is not a "
                        "directory written by Dataset.save_to_disk or DatasetDict.save_to_disk")
    return found


def _read_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(content, dict):
        raise DataError(f"{path} should hold a JSON object, got {type(content).__name__}")
    return content


def _hub_hint(entry: Path) -> str:
    """How to get a Hub dataset's files, for a missing path that could be a Hub name (`openai/gsm8k`)."""
    name = str(entry)
    if entry.is_absolute() or entry.suffix.lower() in DATA_SUFFIXES or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        return ""
    # A dataset with several configurations needs one named (GSM8K's is 'main'); the hint shows where it goes.
    subset = ", 'main'" if name.lower() in _MAIN_CONFIG_DATASETS else ""
    where = "" if subset else " (with the configuration's name as a second argument if it has several)"
    return (f"; nothing is downloaded, so if {name!r} is a Hugging Face Hub dataset, save a local copy first: "
            f"python -c \"import datasets; datasets.load_dataset('{name}'{subset}).save_to_disk('DIR')\"{where} "
            f"(then data.train_files=[DIR], with data.split for the split), or huggingface-cli download {name} "
            "--repo-type dataset --local-dir DIR (then point data.train_files at its .parquet files)")


_MAIN_CONFIG_DATASETS = ("openai/gsm8k", "gsm8k")  # load_dataset refuses them without their 'main' configuration


def _check_template(template: str) -> None:
    if not isinstance(template, str):
        raise DataError(f"prompt_template must be a str, got {type(template).__name__}")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        template.format(question="")
    except (KeyError, IndexError, ValueError) as error:
        fields = {f"<unusable: {error}>"}
    if fields != {"question"}:
        raise DataError(
            f"prompt_template {template!r} must be a str.format template whose only field is {{question}} "
            f"(found {sorted(fields)}; write literal braces as {{{{ and }}}})"
        )
