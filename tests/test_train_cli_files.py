"""`scalerl sft` then `scalerl train` from the command line on GSM8K-format JSONL files (the user's path),
the RL run starting from the SFT run's output directory as the README writes it."""

import json

from scalerl.cli import main
from tests.tiny import tiny_overrides


def _write_gsm8k(path, n, offset=0):
    rows = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(offset, offset + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sft_then_grpo_on_jsonl_files(tmp_path, capsys):
    _write_gsm8k(tmp_path / "train.jsonl", 64)
    _write_gsm8k(tmp_path / "test.jsonl", 8, offset=100)
    common = tiny_overrides(
        "data.task=gsm8k", f"data.train_files=[{tmp_path / 'train.jsonl'}]", f"data.val_files=[{tmp_path / 'test.jsonl'}]",
        "data.prompt_template=Q: {question}\nA:", "rollout.max_new_tokens=24", f"trainer.output_dir={tmp_path / 'run'}",
    )
    assert main(["sft", *common]) == 0
    sft_model = tmp_path / "run" / "sft" / "model"
    assert (sft_model / "model.safetensors").is_file() and (sft_model / "tokenizer.json").is_file()
    assert main(["train", *common, f"trainer.init_from={sft_model}", "actor.ppo_micro_batch_size=8"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/accuracy" in rows[-1]
    assert "data:" in capsys.readouterr().out  # the resolved config is printed before the run


def test_missing_field_names_file_and_row(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    code = main(["train", "data.task=gsm8k", f"data.train_files=[{tmp_path / 'bad.jsonl'}]", "trainer.logger=[jsonl]",
                 f"trainer.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "bad.jsonl" in err and "row 2" in err and "answer" in err


def test_missing_model_directory_is_a_clean_error(tmp_path, capsys):
    code = main(["train", f"model.path={tmp_path / 'nowhere'}", "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path / 'run'}"])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2 and err.startswith("error:") and "config.json" in err and "Traceback" not in err
    assert f"model.path={tmp_path / 'nowhere'}: no such directory here" in err
    assert "model_type=None" not in captured.out + err  # the decoder is not chosen from a file that is not there


def test_sft_output_directory_as_init_from_by_the_readmes_path(tmp_path, capsys):
    _write_gsm8k(tmp_path / "train.jsonl", 64)
    common = tiny_overrides("data.task=gsm8k", f"data.train_files=[{tmp_path / 'train.jsonl'}]", "data.val_fraction=0",
                            "data.prompt_template=Q: {question}\nA:", "rollout.max_new_tokens=24", "trainer.total_steps=1",
                            "sft.steps=1")
    sft_dir = tmp_path / "out" / "sft"  # README: `scalerl sft ...`, then trainer.init_from=<its output dir>
    assert main(["sft", *common, f"trainer.output_dir={tmp_path / 'out'}"]) == 0
    assert f"trained model: {sft_dir / 'model'} (" in capsys.readouterr().out
    assert main(["train", *common, f"trainer.init_from={sft_dir}", f"trainer.output_dir={tmp_path / 'rl'}"]) == 0
    captured = capsys.readouterr()
    assert f"trainer.init_from={sft_dir}: the trained model in it, {sft_dir / 'model'}" in captured.err
    assert f"trained model: {tmp_path / 'rl' / 'final'} (" in captured.out
    assert main(["train", *common, f"trainer.init_from={tmp_path}", f"trainer.output_dir={tmp_path / 'rl2'}"]) == 2
    err = capsys.readouterr().err  # a directory with no model in it names every place it looked
    assert f"trainer.init_from={tmp_path} holds no model: no config.json in it, nor in {tmp_path / 'final'}, " \
           f"{tmp_path / 'model'}, {tmp_path / 'sft/model'}" in err
