"""Streaming data: peak memory of a training run does not grow with the dataset, side by side.

    python benchmarks/streaming_memory.py [--large-gb 2] [--small-mb 20] [--steps 20] [--dir /tmp]

Writes two Parquet datasets in verl's gsm8k schema (`data_source`, `prompt` as chat messages, `ability`,
`reward_model: {style, ground_truth}`, `extra_info` with a ~4 KB random `padding` text so the rows weigh
what long real rows weigh and do not compress away) in row groups of 1000 rows (~4.5 MB), into a temporary
directory under ``--dir`` (deleted afterwards): a large one (``--large-gb``, default ~2 GB) and a small one
(``--small-mb``, ~20 MB). Then, each in a fresh child process:

- a ``--steps``-step ``scalerl train`` run (the tiny built-in model of tests/tiny.py, 32 prompts x 2 samples
  a step) with ``data.streaming=true`` on each dataset, and with the whole-file loader (every row read into
  memory) on the small one for reference;
- one whole epoch of the streamed dataset drawn (`StreamingPromptStream.next_batch`, no model), so every
  row group of the large file is read and converted at least once.

Each child's peak resident memory is its own ``ru_maxrss`` (``os.wait4``). It prints the table and the
difference large - small of the streamed runs (the target: within 100 MB, whatever the dataset's size).
The free space of ``--dir`` is checked first (the large dataset needs ``--large-gb`` GB plus a margin).
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow
import pyarrow.parquet

ROW_GROUP_ROWS = 1000
PADDING_CHARS = 4096  # the text per row that makes a row weigh what long real rows weigh
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The tiny run of tests/tiny.py (built-in model, hidden 32, 2 layers), with batches of real-sized prompts.
TRAIN = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "rollout.n=2", "rollout.max_new_tokens=8", "trainer.batch_size=32", "actor.ppo_mini_batch_size=64",
    "actor.ppo_micro_batch_size=16", "trainer.eval_every=0", "trainer.logger=[jsonl]", "trainer.save_every=0",
    "data.reward=gsm8k", "data.max_prompt_length=128",
]
EPOCH_PASS = """
import os, sys
from pathlib import Path
from scalerl.data.streaming import StreamingPromptStream
stream = StreamingPromptStream([Path(sys.argv[1])], 32, 0)
while stream.position + 32 <= stream.share_rows:  # the epoch's whole batches
    stream.next_batch()
print(stream.converted_rows)
"""


def write_dataset(path: Path, target_bytes: int, padding_pool: list[str]) -> tuple[int, int]:
    """Row groups of verl gsm8k rows until the file reaches ``target_bytes``; returns (rows, bytes)."""
    message = pyarrow.struct([("role", pyarrow.string()), ("content", pyarrow.string())])
    rows, group = 0, 0
    with pyarrow.parquet.ParquetWriter(path, _schema(message)) as writer:
        while True:
            index = list(range(rows, rows + ROW_GROUP_ROWS))
            a = [i % 997 for i in index]
            b = [i % 89 for i in index]
            questions = [f"What is {x} + {y}?" for x, y in zip(a, b)]
            answers = [f"{x} + {y} = {x + y}\n#### {x + y}" for x, y in zip(a, b)]
            padding = [padding_pool[(group * 7 + k) % len(padding_pool)] for k in range(ROW_GROUP_ROWS)]
            table = pyarrow.table({
                "data_source": ["openai/gsm8k"] * ROW_GROUP_ROWS,
                "prompt": [[{"role": "user", "content": q + " " + INSTRUCTION}] for q in questions],
                "ability": ["math"] * ROW_GROUP_ROWS,
                "reward_model": [{"style": "rule", "ground_truth": str(x + y)} for x, y in zip(a, b)],
                "extra_info": [{"split": "train", "index": i, "answer": ans, "question": q, "padding": pad}
                               for i, ans, q, pad in zip(index, answers, questions, padding)],
            }, schema=_schema(message))
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
            rows, group = rows + ROW_GROUP_ROWS, group + 1
            if rows * (PADDING_CHARS + 200) >= target_bytes:
                break
    return rows, path.stat().st_size


def _schema(message: pyarrow.DataType) -> pyarrow.Schema:
    return pyarrow.schema([
        ("data_source", pyarrow.string()), ("prompt", pyarrow.list_(message)), ("ability", pyarrow.string()),
        ("reward_model", pyarrow.struct([("style", pyarrow.string()), ("ground_truth", pyarrow.string())])),
        ("extra_info", pyarrow.struct([("split", pyarrow.string()), ("index", pyarrow.int64()),
                                       ("answer", pyarrow.string()), ("question", pyarrow.string()),
                                       ("padding", pyarrow.string())])),
    ])


def peak_rss_of(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(peak RSS in MB, wall seconds, stdout) of ``command`` run as a child process."""
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed ({child.returncode}):\n{output[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start, output  # Linux: ru_maxrss in KiB


def train_command(data: Path, out: Path, steps: int, streaming: bool, rows: int) -> list[str]:
    return [sys.executable, "-m", "scalerl", "train", *TRAIN, f"trainer.total_steps={steps}",
            f"data.train_files=[{data}]", f"data.streaming={str(streaming).lower()}", f"data.num_train={rows}",
            f"trainer.output_dir={out}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large-gb", type=float, default=2.0)
    parser.add_argument("--small-mb", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the datasets are written (and deleted)")
    args = parser.parse_args()
    free_gb = shutil.disk_usage(args.dir).free / 2**30
    if free_gb < args.large_gb * 1.5 + 1:
        raise SystemExit(f"{args.dir} has {free_gb:.1f} GB free; the large dataset needs about {args.large_gb:.1f} GB "
                         "plus a margin: pass --dir or --large-gb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    work = Path(tempfile.mkdtemp(prefix="scalerl-streaming-", dir=args.dir))
    try:
        pool = [base64.b64encode(os.urandom(PADDING_CHARS * 3 // 4)).decode() for _ in range(ROW_GROUP_ROWS * 2)]
        datasets = {}
        for name, target in (("small", args.small_mb * 2**20), ("large", args.large_gb * 2**30)):
            start = time.perf_counter()
            rows, size = write_dataset(work / f"{name}.parquet", int(target), pool)
            datasets[name] = (work / f"{name}.parquet", rows, size)
            print(f"wrote {name}: {rows} rows, {size / 2**20:.0f} MB, {rows // ROW_GROUP_ROWS} row groups "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        del pool
        results = []
        for name, streaming in (("small", True), ("large", True), ("small", False)):
            path, rows, size = datasets[name]
            peak, wall, _ = peak_rss_of(train_command(path, work / f"run-{name}-{streaming}", args.steps, streaming,
                                                      rows), env)
            label = f"{args.steps}-step train, " + ("streaming" if streaming else "whole-file loader")
            results.append((label, name, rows, size, peak, wall))
            print(f"  {label} on {name}: peak RSS {peak:.0f} MB ({wall:.0f} s)", flush=True)
        for name in ("small", "large"):
            path, rows, size = datasets[name]
            peak, wall, output = peak_rss_of([sys.executable, "-c", EPOCH_PASS, str(path)], env)
            results.append((f"one epoch streamed, no model ({output.split()[-1]} read)", name, rows, size, peak, wall))
            print(f"  epoch pass on {name}: peak RSS {peak:.0f} MB ({wall:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'run':<46} {'dataset':>14} {'rows':>8} {'peak RSS MB':>12} {'wall s':>7}")
    for label, name, rows, size, peak, wall in results:
        print(f"{label:<46} {f'{name} {size / 2**20:.0f} MB':>14} {rows:>8} {peak:>12.0f} {wall:>7.0f}")
    by_run = {(label, name): peak for label, name, _, _, peak, _ in results}
    stream_label = f"{args.steps}-step train, streaming"
    small, large = by_run[(stream_label, "small")], by_run[(stream_label, "large")]
    whole = by_run[(f"{args.steps}-step train, whole-file loader", "small")]
    epoch = [peak for label, name, *_, peak, _ in results if label.startswith("one epoch")]
    ratio = datasets["large"][2] / datasets["small"][2]
    print(f"\ndataset {ratio:.0f}x larger: streamed train peak RSS large - small = {large - small:+.0f} MB "
          f"({large / small:.2f}x); target within 100 MB: {'met' if abs(large - small) <= 100 else 'NOT met'}")
    print(f"whole epoch streamed: large - small = {epoch[1] - epoch[0]:+.0f} MB; whole-file loader on the small "
          f"dataset vs streaming it: {whole - small:+.0f} MB")


if __name__ == "__main__":
    main()
