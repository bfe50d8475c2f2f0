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


def _numbered_rows(path, count):
    path.write_text("".join(f'{{"prompt": "{i}+1=", "ground_truth": "{i + 1}"}}\n' for i in range(count)))
    return path


def test_without_val_files_the_held_out_rows_are_carved_from_the_training_files(tmp_path, capsys):
    files = f"data.train_files=[{_numbered_rows(tmp_path / 'train.jsonl', 100)}]"
    data = load_config(None, [files, "data.val_fraction=0.05"]).data
    train, held_out = rows_from_config(data, "train", seed=3), rows_from_config(data, "test", seed=3)
    assert len(held_out) == 5 and len(train) == 95  # the user's rows, never the built-in task's
    prompts = {row["prompt"] for row in train}
    assert not prompts & {row["prompt"] for row in held_out}
    assert prompts | {row["prompt"] for row in held_out} == {f"{i}+1=" for i in range(100)}
    assert capsys.readouterr().out.splitlines() == [(
        "evaluation: 5 of the 100 rows of data.train_files held out (data.val_fraction=0.05, at most "
        "data.num_val=200, drawn by trainer.seed=3); training uses the other 95")]
    assert rows_from_config(data, "test", seed=3) == held_out  # fixed by the seed
    assert rows_from_config(data, "test", seed=4) != held_out
    data.num_val = 2  # caps the held-out count
    assert len(rows_from_config(data, "test", seed=3)) == 2 and len(rows_from_config(data, "train", seed=3)) == 98


@pytest.mark.parametrize("setting, why", [("data.val_fraction=0", "data.val_fraction=0"),
                                          ("data.val_fraction=0.02", "data.val_fraction=0.02 of 10 rows is less than one")])
def test_too_few_rows_to_hold_out_means_no_evaluation_said_in_one_line(tmp_path, capsys, setting, why):
    files = f"data.train_files=[{_numbered_rows(tmp_path / 'train.jsonl', 10)}]"
    data = load_config(None, [files, setting]).data
    assert rows_from_config(data, "test", seed=0) == []
    assert len(rows_from_config(data, "train", seed=0)) == 10
    assert capsys.readouterr().out.splitlines() == [
        f"evaluation: none ({why}; give data.val_files, or raise data.val_fraction, to evaluate)"]


def test_the_built_in_task_only_without_any_data_files(tmp_path):
    built_in = load_config(None, ["data.num_val=4"]).data
    assert len(rows_from_config(built_in, "test", seed=0)) == 4  # no data files at all: the arithmetic task
    val = _numbered_rows(tmp_path / "val.jsonl", 3)
    given = load_config(None, [f"data.train_files=[{_numbered_rows(tmp_path / 'train.jsonl', 100)}]",
                               f"data.val_files=[{val}]"]).data
    assert [row["prompt"] for row in rows_from_config(given, "test", seed=0)] == ["0+1=", "1+1=", "2+1="]
    assert len(rows_from_config(given, "train", seed=0)) == 100  # all of them: nothing is held out
