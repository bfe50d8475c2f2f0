"""GSM8K/MATH/row-format loading from JSON lines and Parquet, and the errors for bad rows."""

import json

import pyarrow
import pyarrow.parquet
import pytest

from scalerl.data.errors import DataError
from scalerl.data.loaders import DEFAULT_PROMPT_TEMPLATE, load_rows

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?", "answer": "1000*2=2000\n#### 2,000"},
]
MATH = [
    {"problem": "What is $1/2 + 1/4$?", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
    {"problem": "Find $x$ if $x+1=3$.", "solution": "So $x=\\boxed{2}$.", "answer": "2"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_parquet(path, records):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), path)
    return path


def test_gsm8k_jsonl_rows(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), kind="gsm8k")
    assert rows == [
        {
            "prompt": DEFAULT_PROMPT_TEMPLATE.format(question=GSM8K[0]["question"]),
            "response": " " + GSM8K[0]["answer"],
            "ground_truth": "7",
        },
        {
            "prompt": DEFAULT_PROMPT_TEMPLATE.format(question=GSM8K[1]["question"]),
            "response": " " + GSM8K[1]["answer"],
            "ground_truth": "2000",
        },
    ]


def test_math_parquet_rows_with_auto_kind_and_template(tmp_path):
    rows = load_rows(str(write_parquet(tmp_path / "math.parquet", MATH)), prompt_template="P: {question}\nS:")
    assert [row["ground_truth"] for row in rows] == ["\\frac{3}{4}", "2"]
    assert rows[0]["prompt"] == "P: What is $1/2 + 1/4$?\nS:"
    assert rows[1]["response"] == " So $x=\\boxed{2}$."


def test_several_files_directories_globs_and_limit(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", GSM8K)
    write_parquet(tmp_path / "b.parquet", MATH)
    assert len(load_rows(tmp_path)) == 4
    assert len(load_rows([tmp_path / "a.jsonl", tmp_path / "b.parquet"], limit=3)) == 3
    assert [row["ground_truth"] for row in load_rows(str(tmp_path / "*.parquet"))] == ["\\frac{3}{4}", "2"]
    assert load_rows(tmp_path, limit=0) == []


def test_rows_kind_passes_through(tmp_path):
    records = [{"prompt": "Q:1+1\nA:", "response": " #### 2", "ground_truth": "2", "difficulty": 1}]
    assert load_rows(write_jsonl(tmp_path / "rows.jsonl", records)) == records


def test_missing_field_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GSM8K[0], {"question": "no answer here"}])
    with pytest.raises(DataError, match=r"bad\.jsonl, row 2: missing field 'answer'"):
        load_rows(path, kind="gsm8k")


def test_unparseable_answers_name_the_row(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [GSM8K[0], GSM8K[1], {"question": "q", "answer": "seven"}])
    with pytest.raises(DataError, match=r"bad\.parquet, row 3: .*'#### <number>'"):
        load_rows(path)
    path = write_jsonl(tmp_path / "bad_math.jsonl", [{"problem": "p", "solution": "\\boxed{3"}])
    with pytest.raises(DataError, match=r"row 1: .*\\boxed"):
        load_rows(path, kind="math")


@pytest.mark.parametrize(
    "setup, kwargs, message",
    [
        (lambda tmp: tmp / "missing.jsonl", {}, "does not exist"),
        (lambda tmp: (tmp / "x.csv").write_text("a,b\n") and tmp / "x.csv", {}, "unsupported file type '.csv'"),
        (lambda tmp: (tmp / "x.jsonl").write_text("{bad json}\n") and tmp / "x.jsonl", {}, "cannot be read"),
        (lambda tmp: write_jsonl(tmp / "x.jsonl", [{"text": "hi"}]), {}, "cannot tell the data kind"),
        (lambda tmp: write_jsonl(tmp / "x.jsonl", GSM8K), {"kind": "csv"}, "kind 'csv'"),
        (lambda tmp: write_jsonl(tmp / "x.jsonl", GSM8K), {"prompt_template": "{q}"}, "only field is {question}"),
        (lambda tmp: write_jsonl(tmp / "x.jsonl", GSM8K), {"prompt_template": "no field"}, "only field"),
        (lambda tmp: tmp / "*.parquet", {}, "matches no files"),
    ],
)
def test_bad_inputs_raise_clear_errors(tmp_path, setup, kwargs, message):
    with pytest.raises(DataError, match=message):
        load_rows(setup(tmp_path), **kwargs)
