"""`scalerl train` from the command line on a verl-format GSM8K-style parquet and on a TRL-format dataset
saved with `DatasetDict.save_to_disk` (the user's path: their files, unchanged); without data.val_files,
evaluation runs on rows held out from the user's file, scored by the user's reward."""

import json

import pytest

from scalerl.cli import main
from tests.data.test_formats import verl_gsm8k_dataset
from tests.tiny import tiny_overrides

# One or two RL steps of the built-in model, small enough for a busy CPU (prompts of real data are longer).
TINY = tiny_overrides("actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8", "trainer.eval_every=0",
                      "trainer.logger=[jsonl]", "data.max_prompt_length=128")


def _problems(count, offset=0):
    """GSM8K-shaped raw rows of small sums, for verl's preprocessing to map."""
    return [{"question": f"What is {i} + {i % 7}?", "answer": f"{i} + {i % 7} = {i + i % 7}\n#### {i + i % 7}"}
            for i in range(offset, offset + count)]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_on_verl_gsm8k_parquet(tmp_path):
    verl_gsm8k_dataset(_problems(16)).to_parquet(str(tmp_path / "train.parquet"))
    verl_gsm8k_dataset(_problems(4, offset=100), "test").to_parquet(str(tmp_path / "test.parquet"))
    run = tmp_path / "run"
    assert main(["train", *TINY, f"trainer.output_dir={run}", "trainer.total_steps=2", "data.reward=gsm8k",
                 f"data.train_files=[{tmp_path / 'train.parquet'}]",
                 f"data.val_files=[{tmp_path / 'test.parquet'}]"]) == 0
    steps = [row for row in _metrics(run) if "critic/score/mean" in row]
    assert len(steps) == 2 and all(row["reward/num_failures"] == 0 for row in steps)
    assert "val/accuracy" in _metrics(run)[-1]  # the held-out verl rows were generated from and scored


def test_train_on_trl_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": str(i + 1), "level": 3}
               for i in range(8)]
    split = datasets.Dataset.from_list(records)
    datasets.DatasetDict({"train": split, "validation": split.select(range(2))}).save_to_disk(str(tmp_path / "ds"))
    # The row reaches the reward: TRL's extra columns under "columns", the ground truth from data.ground_truth_key.
    reward = tmp_path / "row_reward.py"
    reward.write_text("def score(response, ground_truth, row):\n"
                      "    return float(row['columns']['level'] == 3 and ground_truth == row['columns']['solution'])\n")
    run = tmp_path / "run"
    assert main(["train", *TINY, f"trainer.output_dir={run}", "trainer.total_steps=1", f"data.reward={reward}:score",
                 f"data.train_files=[{tmp_path / 'ds'}]", "data.split=train", "data.ground_truth_key=solution"]) == 0
    (step,) = [row for row in _metrics(run) if "critic/score/mean" in row]
    assert step["critic/score/mean"] == 1.0 and step["reward/num_failures"] == 0


def test_sft_on_trl_prompt_completion_jsonl(tmp_path):
    records = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                "completion": [{"role": "assistant", "content": f" {i + 1}"}]} for i in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    run = tmp_path / "run"
    assert main(["sft", *TINY, f"trainer.output_dir={run}", f"data.train_files=[{tmp_path / 'sft.jsonl'}]",
                 "sft.steps=2", "sft.batch_size=4", "sft.micro_batch_size=4"]) == 0
    assert (run / "sft" / "model" / "model.safetensors").is_file()


def test_verl_job_as_it_is_parquet_reward_file_and_auto_scorer(tmp_path):
    """verl's data and a verl reward file returning a dict: the score trains, its extra numbers are logged
    as ``reward/extra/*``; with ``data.reward=auto`` the rows' data_source picks verl's GSM8K scorer."""
    verl_gsm8k_dataset(_problems(16)).to_parquet(str(tmp_path / "train.parquet"))
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    assert data_source == 'openai/gsm8k' and extra_info['split'] == 'train'\n"
                      "    return {'score': 0.25, 'chars': float(len(solution_str)), 'has_hash': '#' in solution_str}\n")
    run = tmp_path / "run"
    assert main(["train", *TINY, f"trainer.output_dir={run}", "trainer.total_steps=1",
                 f"data.reward={reward}:compute_score", f"data.train_files=[{tmp_path / 'train.parquet'}]"]) == 0
    (step,) = [row for row in _metrics(run) if "critic/score/mean" in row]
    assert step["critic/score/mean"] == 0.25 and step["reward/num_failures"] == 0
    assert 0 < step["reward/extra/chars"] and 0 <= step["reward/extra/has_hash"] <= 1
    auto = tmp_path / "auto"
    assert main(["train", *TINY, f"trainer.output_dir={auto}", "trainer.total_steps=1", "data.reward=auto",
                 f"data.train_files=[{tmp_path / 'train.parquet'}]"]) == 0
    (step,) = [row for row in _metrics(auto) if "critic/score/mean" in row]
    assert step["reward/num_failures"] == 0 and 0 <= step["critic/score/mean"] <= 1


def test_trl_reward_on_a_users_file_evaluates_on_rows_held_out_from_it(tmp_path, capsys):
    rows = [{"prompt": f"{i}+1=", "solution": str(i + 1)} for i in range(100)]
    (tmp_path / "trl.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    # A TRL reward that needs the file's own column; it records the solutions it scored.
    seen = tmp_path / "seen.txt"
    (tmp_path / "acc.py").write_text(
        "def accuracy(prompts, completions, solution, **kwargs):\n"
        f"    open({str(seen)!r}, 'a').write(''.join(s + '\\n' for s in solution))\n"
        "    return [float(c.strip() == s) for c, s in zip(completions, solution)]\n")
    run = tmp_path / "run"
    assert main(["train", *TINY, f"trainer.output_dir={run}", "trainer.total_steps=1",
                 f"data.reward={tmp_path / 'acc.py'}:accuracy", f"data.train_files=[{tmp_path / 'trl.jsonl'}]",
                 "data.val_fraction=0.04"]) == 0
    assert ("evaluation: 4 of the 100 rows of data.train_files held out (data.val_fraction=0.04, at most "
            "data.num_val=8, drawn by trainer.seed=0); training uses the other 96") in capsys.readouterr().out
    initial, *_ = _metrics(run)
    assert initial["step"] == 0 and "val/accuracy" in initial
    scored = seen.read_text().split()
    assert len(scored) == 4 + 4 * 4 + 4  # evaluation at step 0, one step of 4 prompts x 4 samples, the last evaluation
    assert set(scored) <= {row["solution"] for row in rows}  # the user's rows only, never the built-in task's
    assert not set(scored[:4]) & set(scored[4:20])  # the held-out rows are not trained on


@pytest.mark.parametrize("short_split", ["train", "val"])
def test_a_reward_needing_a_column_one_split_lacks_is_refused_before_training_naming_that_split(
        tmp_path, capsys, short_split):
    full = [{"prompt": f"{i}+1=", "solution": str(i + 1)} for i in range(40)]
    short = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    files = {"train": full, "val": full, short_split: short}
    for split, rows in files.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "acc.py").write_text("def accuracy(prompts, completions, solution, **kwargs):\n"
                                     "    return [float(c.strip() == s) for c, s in zip(completions, solution)]\n")
    run = tmp_path / "run"
    assert main(["train", *TINY, f"trainer.output_dir={run}", "trainer.total_steps=1",
                 f"data.reward={tmp_path / 'acc.py'}:accuracy", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                 f"data.val_files=[{tmp_path / 'val.jsonl'}]"]) == 2
    name, key = ("training", "train_files") if short_split == "train" else ("validation", "val_files")
    assert (f"reward accuracy needs 'solution', which the {name} rows (data.{key}: {tmp_path / (short_split + '.jsonl')})"
            " do not give (their columns: ['answer'])") in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists() or not _metrics(run)  # refused before any step


def test_sft_row_without_a_response_names_the_file(tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)})
                                                    + "\n" for i in range(8)))
    assert main(["sft", *TINY, f"trainer.output_dir={tmp_path / 'run'}",
                 f"data.train_files=[{tmp_path / 'prompts.jsonl'}]"]) == 2
    assert (f"SFT row 1 of data.train_files ({tmp_path / 'prompts.jsonl'}) has no 'response' text to train on"
            in capsys.readouterr().err)
