"""Read GSM8K-style and MATH-style problems from JSONL or Parquet files into the package's row format.

Output rows are `{"prompt": str, "response": str, "ground_truth": str}` (see `scalerl.data.arithmetic`):

    kind="gsm8k"  input {"question", "answer"}   the answer ends in "#### <number>"
                  -> prompt = template(question), response = " " + answer, ground_truth = the number
    kind="math"   input {"problem", "solution"}  the solution contains "\\boxed{...}"; an "answer"
                  field, where present (as in MATH-500), is used as the ground truth instead
                  -> prompt = template(problem), response = " " + solution, ground_truth = the boxed text
    kind="rows"   input already {"prompt", "ground_truth"} and optionally "response"; passed through
    kind="auto"   chosen per file from its columns

`prompt_template` is a `str.format` template with one field, `{question}` (the MATH problem too);
the default, `DEFAULT_PROMPT_TEMPLATE`, is "Question: {question}\\nAnswer:". Responses start with a
space so that prompt + response reads naturally and BPE tokenizers see " word" tokens.

Files are read with `pyarrow` (a core dependency): `.jsonl`/`.json`/`.ndjson` as JSON lines, `.parquet`
as Parquet. A path may be a file, a directory (all such files in it, sorted) or a glob pattern. Any bad
row raises `DataError` naming the file, the 1-based row number (blank lines are not counted) and the field.
"""

from __future__ import annotations

import glob
import string
from pathlib import Path
from typing import Any, Iterator, Sequence

from scalerl.data.answers import extract_boxed, extract_hash_answer
from scalerl.data.errors import DataError

DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
KINDS = ("auto", "gsm8k", "math", "rows")
JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# The columns that identify each kind, in the order "auto" tries them.
_KIND_COLUMNS = {"rows": ("prompt", "ground_truth"), "gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def load_rows(
    path_or_paths: str | Path | Sequence[str | Path],
    kind: str = "auto",
    prompt_template: str | None = None,
    limit: int | None = None,
) -> list[dict]:
    """All rows of the given files (in order), converted to the row format; at most `limit` of them."""
    if kind not in KINDS:
        raise DataError(f"data kind {kind!r} is not one of {KINDS}")
    template = DEFAULT_PROMPT_TEMPLATE if prompt_template is None else prompt_template
    _check_template(template)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit={limit!r} must be a non-negative integer or None")
    rows: list[dict] = []
    for path in _expand_paths(path_or_paths):
        for row in _convert_file(path, kind, template, template_given=prompt_template is not None):
            if limit is not None and len(rows) >= limit:
                return rows
            rows.append(row)
    return rows


def _convert_file(path: Path, kind: str, template: str, template_given: bool) -> Iterator[dict]:
    records = _read_records(path)
    file_kind = kind if kind != "auto" else _detect_kind(path, records)
    if file_kind == "rows" and template_given:  # such rows keep their own prompt: a template would do nothing
        raise DataError(f"{path}: its rows already hold a 'prompt' field, so data.prompt_template={template!r} "
                        "would be ignored; remove data.prompt_template, or give question/answer rows")
    convert = {"gsm8k": _gsm8k_row, "math": _math_row, "rows": _passthrough_row}[file_kind]
    for number, record in enumerate(records, start=1):
        yield convert(_RowContext(path, number, record), template)


class _RowContext:
    """One input record and where it came from, so every error can name the file and row."""

    def __init__(self, path: Path, number: int, record: dict[str, Any]):
        self.path, self.number, self.record = path, number, record

    def error(self, message: str) -> DataError:
        return DataError(f"{self.path}, row {self.number}: {message}")

    def text_field(self, field: str, kind: str) -> str:
        """The text in `field`; a missing (or null) field or a non-text value raises `DataError`."""
        value = self.record.get(field)
        if value is None:
            present = sorted(key for key, value in self.record.items() if value is not None)
            raise self.error(f"missing field {field!r} needed for {kind} rows (fields present: {present})")
        if not isinstance(value, str):
            raise self.error(f"field {field!r} should be text, got {type(value).__name__} {value!r:.60}")
        return value


def _gsm8k_row(row: _RowContext, template: str) -> dict:
    question, answer = row.text_field("question", "gsm8k"), row.text_field("answer", "gsm8k")
    ground_truth = extract_hash_answer(answer)
    if ground_truth is None:
        raise row.error(f"field 'answer' has no '#### <number>' final answer: {answer[-80:]!r}")
    return {"prompt": template.format(question=question), "response": " " + answer, "ground_truth": ground_truth}


def _math_row(row: _RowContext, template: str) -> dict:
    problem, solution = row.text_field("problem", "math"), row.text_field("solution", "math")
    ground_truth = row.record.get("answer")
    if ground_truth is None:
        ground_truth = extract_boxed(solution)
        if ground_truth is None:
            raise row.error(f"field 'solution' has no complete \\boxed{{...}} answer: {solution[-80:]!r}")
    elif not isinstance(ground_truth, str):
        ground_truth = str(ground_truth)
    return {"prompt": template.format(question=problem), "response": " " + solution, "ground_truth": ground_truth}


def _passthrough_row(row: _RowContext, template: str) -> dict:
    converted = dict(row.record)
    for field in ("prompt", "ground_truth"):
        converted[field] = row.text_field(field, "prompt/ground_truth")
    if converted.get("response") is None:
        converted.pop("response", None)
    return converted


def _detect_kind(path: Path, records: list[dict]) -> str:
    columns = set(records[0]) if records else set()
    for kind, needed in _KIND_COLUMNS.items():
        if set(needed) <= columns:
            return kind
    expected = "; ".join(f"{kind}: {', '.join(fields)}" for kind, fields in _KIND_COLUMNS.items())
    raise DataError(f"{path}: cannot tell the data kind from its fields {sorted(columns)}; expected ({expected})")


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The file's records as dicts, read with pyarrow."""
    suffix = path.suffix.lower()
    try:
        if suffix in JSON_LINES_SUFFIXES:
            import pyarrow.json

            table = pyarrow.json.read_json(path)
        elif suffix in PARQUET_SUFFIXES:
            import pyarrow.parquet

            table = pyarrow.parquet.read_table(path)
        else:
            raise DataError(
                f"{path}: unsupported file type {suffix!r}; use JSON lines ({', '.join(JSON_LINES_SUFFIXES)}) "
                f"or Parquet ({', '.join(PARQUET_SUFFIXES)})"
            )
    except DataError:
        raise
    except Exception as error:  # pyarrow.ArrowInvalid and friends; pyarrow counts rows from 0
        expected = "JSON lines (one object per line)" if suffix in JSON_LINES_SUFFIXES else "Parquet"
        raise DataError(f"{path}: cannot be read as {expected} (pyarrow counts rows from 0): {error}") from error
    try:
        return table.to_pylist()
    except UnicodeDecodeError as error:  # pyarrow reads the bytes unchecked and fails only when converting
        raise DataError(f"{path}{_first_non_utf8_row(path)}: text is not UTF-8 ({error.reason}); convert the "
                        "file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _first_non_utf8_row(path: Path) -> str:
    """", row N" for the first JSON line that is not UTF-8 (blank lines not counted); "" for other files."""
    if path.suffix.lower() not in JSON_LINES_SUFFIXES:
        return ""
    number = 0
    with open(path, "rb") as lines:
        for line in lines:
            if not line.strip():
                continue
            number += 1
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return f", row {number}"
    return ""


def _expand_paths(path_or_paths: str | Path | Sequence[str | Path]) -> list[Path]:
    entries = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    if not entries:
        raise DataError("no data files given")
    paths: list[Path] = []
    for entry in entries:
        entry = Path(entry)
        if entry.is_dir():
            found = sorted(p for p in entry.iterdir() if p.suffix.lower() in JSON_LINES_SUFFIXES + PARQUET_SUFFIXES)
            if not found:
                raise DataError(f"directory {entry} holds no .jsonl, .json, .ndjson or .parquet files")
            paths.extend(found)
        elif entry.is_file():
            paths.append(entry)
        elif glob.has_magic(str(entry)):
            found = sorted(Path(match) for match in glob.glob(str(entry)))
            if not found:
                raise DataError(f"pattern {str(entry)!r} matches no files")
            paths.extend(found)
        else:
            raise DataError(f"data file {str(entry)!r} does not exist (relative to {Path.cwd()})")
    return paths


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
