"""verl's and TRL's data formats, Hugging Face dataset files and directories, chat-message prompts, and the
errors for their bad rows."""

import json

import pyarrow
import pyarrow.ipc
import pyarrow.parquet
import pytest

from scalerl.data.errors import DataError
from scalerl.data.formats import ColumnNames, reward_columns
from scalerl.data.loaders import load_rows
from scalerl.data.prompts import check_prompts, encode_prompts
from scalerl.models.tokenizer import CharTokenizer, TokenizerError

GSM8K_RAW = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?", "answer": "1000*2=2000\n#### 2000"},
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_gsm8k_dataset(raw_rows, split="train"):
    """`raw_rows` mapped exactly as verl's examples/data_preprocess/gsm8k.py maps openai/gsm8k."""
    datasets = pytest.importorskip("datasets")

    def process_fn(example, idx):
        question_raw = example.pop("question")
        question = question_raw + " " + INSTRUCTION
        answer_raw = example.pop("answer")
        solution = answer_raw.split("#### ")[1].replace(",", "")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw},
        }

    return datasets.Dataset.from_list(raw_rows).map(process_fn, with_indices=True)


def write_parquet(path, records):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), path)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def verl_record(content="What is 2+3?", ground_truth="5", **changes):
    record = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": content}], "ability": "math",
              "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": {"index": 0}}
    record.update(changes)
    return record


# ------------------------------------------------------------------------------------------------ verl


def test_verl_gsm8k_parquet_as_verl_writes_it(tmp_path):
    path = tmp_path / "train.parquet"
    verl_gsm8k_dataset(GSM8K_RAW).to_parquet(str(path))
    for kind in ("auto", "verl"):
        rows = load_rows(path, kind=kind)
        assert [row["ground_truth"] for row in rows] == ["7", "2000"]
        first = rows[0]
        assert first["prompt"] == [{"role": "user", "content": GSM8K_RAW[0]["question"] + " " + INSTRUCTION}]
        assert (first["data_source"], first["ability"]) == ("openai/gsm8k", "math")
        assert first["reward_model"] == {"style": "rule", "ground_truth": "7"}
        assert first["extra_info"] == {"split": "train", "index": 0, "answer": GSM8K_RAW[0]["answer"],
                                       "question": GSM8K_RAW[0]["question"]}
        assert set(first["columns"]) == {"data_source", "ability", "reward_model", "extra_info"}
        assert "response" not in first
    # a task's own format is tried first, but a verl file is still read as verl
    assert load_rows(path, prefer="gsm8k")[1]["ground_truth"] == "2000"


def test_verl_plain_prompt_missing_extra_info_and_ground_truth_types(tmp_path):
    records = [verl_record(prompt="Q: 2+3\nA:"), verl_record(ground_truth="6", extra_info=None, data_source=None)]
    rows = load_rows(write_jsonl(tmp_path / "verl.jsonl", records))
    assert rows[0]["prompt"] == "Q: 2+3\nA:"
    assert rows[1]["extra_info"] == {} and rows[1]["data_source"] is None  # as verl's RLHFDataset makes it
    # ground truths reach verl reward functions as written: a list stays a list
    rows = load_rows(write_jsonl(tmp_path / "list.jsonl", [verl_record(ground_truth=["5", "five"])]))
    assert rows[0]["ground_truth"] == ["5", "five"]


def test_column_name_overrides(tmp_path):
    record = {"source": "my/set", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "2+3?"}],
              "reward_model": {"target": "5"}}
    path = write_parquet(tmp_path / "custom.parquet", [record])
    names = ColumnNames(prompt="messages", ground_truth="reward_model.target", data_source="source")
    (row,) = load_rows(path, columns=names)
    assert row["prompt"] == record["messages"] and row["ground_truth"] == "5" and row["data_source"] == "my/set"
    assert "messages" not in row["columns"] and row["columns"]["source"] == "my/set"
    with pytest.raises(DataError, match=r"custom\.parquet: cannot tell the data kind .*data\.prompt_key"):
        load_rows(path)  # no "prompt" column under the default names


def test_parquet_nulls_of_missing_message_fields_are_dropped(tmp_path):
    # A struct column unifies its fields: the user message gets "name": None on the way back.
    record = verl_record(prompt=[{"role": "system", "content": "Be brief.", "name": "sys"},
                                 {"role": "user", "content": "2+3?"}])
    (row,) = load_rows(write_parquet(tmp_path / "named.parquet", [record]))
    assert row["prompt"] == record["prompt"]


@pytest.mark.parametrize("change, message", [
    ({"reward_model": {"style": "rule"}}, r"row 2: missing field 'reward_model\.ground_truth' needed for verl"),
    ({"reward_model": "5"}, r"row 2: field 'reward_model' should be a dict"),
    ({"prompt": [{"role": "robot", "content": "hi"}]}, r"row 2: field 'prompt\[0\]\.role' is 'robot'"),
    ({"prompt": [{"role": "user", "content": 7}]}, r"row 2: field 'prompt\[0\]\.content' should be text"),
    ({"prompt": [{"role": "user"}]}, r"row 2: field 'prompt\[0\]\.content' should be text .*missing"),
    ({"prompt": ["hi"]}, r"row 2: field 'prompt\[0\]' should be a chat message"),
    ({"prompt": []}, r"row 2: field 'prompt' is an empty list"),
    ({"prompt": 12}, r"row 2: field 'prompt' should be text or a list of chat messages"),
    ({"prompt": None}, r"row 2: missing field 'prompt' needed for verl"),
    ({"extra_info": "x"}, r"row 2: field 'extra_info' should be a dict"),
    ({"data_source": 3}, r"row 2: field 'data_source' should be text"),
])
def test_bad_verl_rows_name_file_row_and_field(tmp_path, change, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(verl_record()) + "\n" + json.dumps(verl_record(**change)) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, " + message):
        load_rows(path, kind="verl")


def test_template_with_own_prompt_formats_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "verl.jsonl", [verl_record()])
    with pytest.raises(DataError, match=r"verl\.jsonl: .*\(verl format\).*data\.prompt_template"):
        load_rows(path, prompt_template="Q: {question}")


# ------------------------------------------------------------------------------------------------- TRL


def test_trl_standard_and_conversational(tmp_path):
    standard = [{"prompt": "The sky is", "completion": " blue.", "solution": "blue", "level": 1},
                {"prompt": "Grass is", "solution": "green", "level": 2}]
    rows = load_rows(write_parquet(tmp_path / "standard.parquet", standard))
    assert rows[0] == {"prompt": "The sky is", "response": " blue.", "columns": {"solution": "blue", "level": 1}}
    assert rows[1] == {"prompt": "Grass is", "columns": {"solution": "green", "level": 2}}
    rows = load_rows(tmp_path / "standard.parquet", columns=ColumnNames(ground_truth="solution"))
    assert [row["ground_truth"] for row in rows] == ["blue", "green"]

    conversational = [{"prompt": [{"role": "user", "content": "2+3?"}],
                       "completion": [{"role": "assistant", "content": "5"}], "answer": "5"}]
    (row,) = load_rows(write_jsonl(tmp_path / "chat.jsonl", conversational), kind="trl")
    assert row == {"prompt": conversational[0]["prompt"], "response": "5", "columns": {"answer": "5"}}

    bad = [{"prompt": "x", "completion": [{"role": "user", "content": "5"}]}]
    with pytest.raises(DataError, match=r"bad\.jsonl, row 1: field 'completion\[0\]\.role' is 'user'"):
        load_rows(write_jsonl(tmp_path / "bad.jsonl", bad))
    with pytest.raises(DataError, match=r"row 1: missing field 'solution' needed for trl"):
        load_rows(write_jsonl(tmp_path / "none.jsonl", [{"prompt": "x"}]), columns=ColumnNames(ground_truth="solution"))


def test_conversational_prompt_with_ground_truth_is_a_rows_file(tmp_path):
    records = [{"prompt": [{"role": "user", "content": "2+3?"}], "ground_truth": "5", "level": 1}]
    assert load_rows(write_jsonl(tmp_path / "rows.jsonl", records)) == records


def test_reward_columns_are_what_trl_passes():
    assert reward_columns({"prompt": "p", "response": "r", "columns": {"solution": "5"}}) == {"solution": "5"}
    assert reward_columns({"prompt": "p", "response": "r", "ground_truth": "5", "difficulty": 1}) == {
        "ground_truth": "5", "difficulty": 1}


# ---------------------------------------------------------------------------------- Hugging Face files


def test_save_to_disk_directories_arrow_and_json(tmp_path):
    datasets = pytest.importorskip("datasets")
    train, test = verl_gsm8k_dataset(GSM8K_RAW), verl_gsm8k_dataset(GSM8K_RAW[:1], "test")
    train.save_to_disk(str(tmp_path / "one"), num_shards=2)  # two shards, read in state.json's order
    assert [row["ground_truth"] for row in load_rows(tmp_path / "one")] == ["7", "2000"]
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_rows(tmp_path / "dict")) == 2
    (row,) = load_rows(tmp_path / "dict", split="test")
    assert row["extra_info"]["split"] == "test"
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train', 'test'\], not 'validation'.*data\.split"):
        load_rows(tmp_path / "dict", split="validation")
    shard = min((tmp_path / "dict" / "train").glob("*.arrow"))
    assert [row["ground_truth"] for row in load_rows(shard)] == ["7", "2000"]  # an Arrow stream file
    train.to_json(str(tmp_path / "train.jsonl"))
    assert load_rows(tmp_path / "train.jsonl") == load_rows(tmp_path / "one")


def test_arrow_ipc_file_and_damaged_saved_dataset(tmp_path):
    table = pyarrow.Table.from_pylist([{"prompt": "Q: 1+1\nA:", "ground_truth": "2"}])
    with pyarrow.ipc.new_file(str(tmp_path / "rows.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert load_rows(tmp_path / "rows.arrow") == table.to_pylist()
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-0.arrow"}]}))
    with pytest.raises(DataError, match=r"shards .*data-0\.arrow.* are missing"):
        load_rows(tmp_path / "saved")
    (tmp_path / "broken.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=r"broken\.arrow: cannot be read as Arrow IPC"):
        load_rows(tmp_path / "broken.arrow")


def test_hub_name_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"'openai/gsm8k' does not exist.*nothing is downloaded.*"
                                        r"load_dataset\('openai/gsm8k', 'main'\)\.save_to_disk.*"
                                        r"huggingface-cli download openai/gsm8k --repo-type dataset"):
        load_rows("openai/gsm8k")  # as docs/configuration.md writes it: GSM8K has no default configuration
    with pytest.raises(DataError, match=r"load_dataset\('someone/set'\)\.save_to_disk\('DIR'\)\" \(with the "
                                        r"configuration's name as a second argument if it has several\)"):
        load_rows("someone/set")
    with pytest.raises(DataError) as error:
        load_rows("missing.jsonl")
    assert "huggingface-cli" not in str(error.value)  # a file name is not a Hub name


def test_non_utf8_parquet_names_row_and_field(tmp_path):
    good = pyarrow.array([b"ok", b"fine", b"caf\xe9"], pyarrow.binary())
    prompts = pyarrow.Array.from_buffers(pyarrow.string(), 3, good.buffers())  # invalid UTF-8, unchecked
    table = pyarrow.table({"prompt": prompts, "ground_truth": ["1", "2", "3"]})
    pyarrow.parquet.write_table(table, tmp_path / "latin1.parquet")
    with pytest.raises(DataError, match=r"latin1\.parquet, row 3, field 'prompt': text is not UTF-8"):
        load_rows(tmp_path / "latin1.parquet")


def test_task_format_goes_first_and_others_task_is_not_tried(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1?", "solution": "\\boxed{2}"}])
    with pytest.raises(DataError, match=r"row 1: missing field 'question' needed for gsm8k"):
        load_rows(path, prefer="gsm8k")  # as data.task=gsm8k always did
    assert load_rows(path)[0]["ground_truth"] == "2"


# ------------------------------------------------------------------------------------ encoding prompts

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_message_prompts_go_through_the_chat_template():
    tokenizer = CharTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    # the built-in tokenizer's template joins the contents; a template adds no BOS
    assert encode_prompts(tokenizer, [messages]) == [tokenizer.encode("Be brief.2+3?")]
    assert encode_prompts(tokenizer, ["2+3?"]) == [[tokenizer.bos_token_id] + tokenizer.encode("2+3?")]
    tokenizer.chat_template = CHATML
    (ids,) = encode_prompts(tokenizer, [messages])
    assert tokenizer.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    tokenizer.chat_template = None
    with pytest.raises(TokenizerError, match="list of chat messages, which needs the tokenizer's chat template"):
        encode_prompts(tokenizer, [messages])
    assert encode_prompts(tokenizer, ["2+3?"])  # text prompts still need no template
    with pytest.raises(DataError, match=r"validation row 2: .*chat template"):
        check_prompts(tokenizer, [{"prompt": "2+3?"}, {"prompt": messages}], False, 64, "validation")


def test_json_lines_whose_field_types_vary_by_row(tmp_path):
    # pyarrow wants one type per column; JSON lets it vary, so such files are read line by line
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(verl_record(ground_truth=5)) + "\n\n" + json.dumps(verl_record(ground_truth="6")) + "\n")
    assert [row["ground_truth"] for row in load_rows(path)] == [5, "6"]
    path.write_text(json.dumps(verl_record()) + "\n\n[1, 2]\n")
    with pytest.raises(DataError, match=r"mixed\.jsonl, row 2: cannot be read as JSON lines .*a list, not an object"):
        load_rows(path)
