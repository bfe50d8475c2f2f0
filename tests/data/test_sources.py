"""The rows a run's `data` section asks for: data files without a row are an error naming each file."""

from __future__ import annotations

import pytest

from scalerl.core.config import load_config
from scalerl.data.errors import DataError
from scalerl.data.sources import rows_from_config


@pytest.mark.parametrize("task", ["gsm8k", "arithmetic"])  # the task's format preferred, or told from the rows
@pytest.mark.parametrize("given", ["rows.jsonl", "'*.jsonl'", "."])  # a file, a pattern, a directory
def test_training_files_without_a_row_are_named_with_the_fix(tmp_path, monkeypatch, given, task):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text("")
    (tmp_path / "more.jsonl").write_text("\n\n")  # blank lines are not rows
    data = load_config(None, [f"data.task={task}", f"data.train_files=[{given}]"]).data
    with pytest.raises(DataError) as raised:
        rows_from_config(data, "train", seed=0)
    message = str(raised.value)
    named = "rows.jsonl" if given == "rows.jsonl" else "more.jsonl, rows.jsonl"
    assert message.startswith(f"the training set is empty: no rows in data.train_files ({named}); put rows in them")
    assert message.endswith("or point data.train_files at the right files")


def test_held_out_files_without_a_row_are_named_unless_none_are_asked_for(tmp_path):
    (tmp_path / "val.jsonl").write_text("")
    data = load_config(None, [f"data.val_files=[{tmp_path / 'val.jsonl'}]"]).data
    with pytest.raises(DataError, match=r"the evaluation set is empty: no rows in data.val_files \(.*val\.jsonl\).*"
                                        r"or remove data.val_files to skip evaluation"):
        rows_from_config(data, "test", seed=0)
    data.num_val = 0
    assert rows_from_config(data, "test", seed=0) == []
