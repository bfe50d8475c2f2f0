"""Per-step metrics appended to ``metrics.jsonl``: one JSON object per line, flushed every step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE_NAME = "metrics.jsonl"


def _is_json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All well-formed step records of a metrics file; a torn last line (a crash mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


class JsonlBackend:
    """Appends ``{"step": n, **metrics}`` lines to ``output_dir/metrics.jsonl``.

    An existing file is appended to, so a resumed run continues its history; ``truncate_after`` first
    drops the lines the resumed run will write again. Values JSON cannot hold are left out; NaN and
    infinity are written as the bare ``NaN`` / ``Infinity`` that Python's and pandas' readers accept.
    """

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / METRICS_FILE_NAME
        self._file = None

    def truncate_after(self, step: int) -> None:
        """Keep only the lines with ``step <= step`` (and drop torn ones), rewriting the file atomically."""
        self._close_file()
        if not self.path.exists():
            return
        kept = [record for record in read_metrics_jsonl(self.path) if record["step"] <= step]
        tmp_path = self.path.with_suffix(".jsonl.tmp")
        with open(tmp_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in kept)
        os.replace(tmp_path, self.path)

    def _open_file(self):
        if self._file is None:
            ends_mid_line = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
            self._file = open(self.path, "a", encoding="utf-8")
            if ends_mid_line:  # a torn line from a crash: end it so the next record starts cleanly
                self._file.write("\n")
        return self._file

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step}
        record.update({k: v for k, v in metrics.items() if k != "step" and _is_json_value(v)})
        f = self._open_file()
        f.write(json.dumps(record) + "\n")
        f.flush()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()
