"""Rows and the reward function a run's `data` config section asks for, and the seeded prompt stream: the
rows in memory (`PromptStream`), or, with ``data.streaming=true``, read lazily from the files
(`scalerl.data.streaming.StreamingPromptStream`); `prompt_stream_from_config` is where the choice is made."""

from __future__ import annotations

import copy
import os
import pickle
import random
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from scalerl.data.arithmetic import make_arithmetic_rows
from scalerl.data.errors import DataError
from scalerl.data.formats import ColumnNames
from scalerl.data.loaders import empty_data_files, expand_paths, load_rows
from scalerl.data.rewards import computer as rewards
from scalerl.data.rewards.computer import RewardComputer
from scalerl.data.streaming import StreamingPromptStream
from scalerl.data.tool_arithmetic import REWARD_SPEC as TOOL_REWARD_SPEC
from scalerl.data.tool_arithmetic import make_tool_arithmetic_rows
from scalerl.parallel.distributed import DistContext

_SPLIT_FILES = {"train": "train_files", "test": "val_files"}
# The built-in tasks' row makers: (split, count, levels, seed) -> rows, when no data files are given.
BUILTIN_TASK_ROWS = {"arithmetic": make_arithmetic_rows, "tool_arithmetic": make_tool_arithmetic_rows}
# data.reward=auto for a built-in task whose reward is not one of the named built-in rewards.
TASK_REWARD_SPECS = {"tool_arithmetic": TOOL_REWARD_SPEC}
_SPLIT_OF_SAVED_DATASET = {"train": "split", "test": "val_split"}  # a DatasetDict directory's split to read


def rows_from_config(data_cfg: Any, split: str, seed: int) -> list[dict]:
    """Train (``split="train"``) or held-out (``"test"``) rows. The built-in task makes both only when no data
    files are given; with ``data.train_files`` and no ``data.val_files``, the held-out rows are carved from the
    training files (`held_out_split`) and the training rows are the rest, never the built-in task's."""
    files = getattr(data_cfg, _SPLIT_FILES[split])
    if split == "test" and not files and data_cfg.train_files:
        return _carved_validation_rows(data_cfg, seed)
    if data_cfg.task in BUILTIN_TASK_ROWS and not data_cfg.train_files and not files:
        count = data_cfg.num_train if split == "train" else data_cfg.num_val
        return BUILTIN_TASK_ROWS[data_cfg.task](split, count, list(data_cfg.difficulty), seed)
    if not files and split == "test":
        return []  # no held-out set: evaluation is skipped
    if not files:
        raise DataError(f"data.task={data_cfg.task!r} needs data.{_SPLIT_FILES[split]} (JSONL, Parquet or Arrow "
                        "files, or a save_to_disk directory)")
    if split == "train" and data_cfg.streaming:
        raise DataError("data.streaming=true is for RL runs (scalerl train), whose prompt stream reads the files "
                        "lazily; SFT reads data.train_files whole: set data.streaming=false")
    rows = _file_rows(data_cfg, split)
    if split == "train" and not data_cfg.val_files:
        rows = held_out_split(rows, _held_out_count(data_cfg, len(rows)), seed)[0]
    return rows


def split_origin(data_cfg: Any, split: str) -> str:
    """Where `rows_from_config`'s rows of ``split`` come from, for messages: "training rows (data.train_files:
    a.jsonl)", "validation rows (held out from data.train_files)", "validation rows (the built-in arithmetic
    task)"."""
    name = "training" if split == "train" else "validation"
    files = getattr(data_cfg, _SPLIT_FILES[split])
    if files:
        return f"{name} rows (data.{_SPLIT_FILES[split]}: {', '.join(map(str, files))})"
    if split == "test" and data_cfg.train_files:
        return f"{name} rows (held out from data.train_files: {', '.join(map(str, data_cfg.train_files))})"
    return f"{name} rows (the built-in {data_cfg.task} task)"


def _file_rows(data_cfg: Any, split: str) -> list[dict]:
    """The rows of the split's files (at most data.num_train / data.num_val of them)."""
    files = getattr(data_cfg, _SPLIT_FILES[split])
    limit = data_cfg.num_train if split == "train" else data_cfg.num_val
    columns = ColumnNames(data_cfg.prompt_key, data_cfg.ground_truth_key, data_cfg.reward_fn_key)
    saved_split = getattr(data_cfg, _SPLIT_OF_SAVED_DATASET[split])
    rows = load_rows(files, kind=data_cfg.format, prompt_template=data_cfg.prompt_template, limit=limit,
                     columns=columns, split=saved_split,
                     prefer=data_cfg.task if data_cfg.task in ("gsm8k", "math") else None)
    if not rows and limit:  # data.num_val=0 asks for none
        raise empty_data_files(expand_paths(files, saved_split), f"data.{_SPLIT_FILES[split]}")
    return rows


def _held_out_count(data_cfg: Any, total: int) -> int:
    """How many of ``total`` training rows are held out: data.val_fraction of them (rounded down), at most
    data.num_val, and always at least one left to train on."""
    return max(0, min(int(data_cfg.val_fraction * total), data_cfg.num_val, total - 1))


def held_out_split(rows: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``rows`` split into (training, held-out): ``count`` rows drawn by ``seed`` are held out, disjoint from
    the rest; both keep the files' order, so the same files and seed give the same split on every rank and
    every resume."""
    held = set(random.Random(f"held_out:{seed}").sample(range(len(rows)), count)) if count else set()
    return ([row for i, row in enumerate(rows) if i not in held], [row for i, row in enumerate(rows) if i in held])


def _carved_validation_rows(data_cfg: Any, seed: int) -> list[dict]:
    """The held-out rows of data.train_files (no data.val_files), said in one line at start; none, with a
    line saying why, where a split cannot or should not be carved."""
    if data_cfg.streaming:
        _say_once("evaluation: none (data.streaming=true reads data.train_files lazily, so no rows are held out; "
                  "give data.val_files to evaluate)")
        return []
    rows = _file_rows(data_cfg, "train")
    count = _held_out_count(data_cfg, len(rows))
    if count == 0:
        why = ("data.val_fraction=0" if data_cfg.val_fraction == 0 else "data.num_val=0" if data_cfg.num_val == 0
               else f"data.val_fraction={data_cfg.val_fraction:g} of {len(rows)} rows is less than one")
        _say_once(f"evaluation: none ({why}; give data.val_files, or raise data.val_fraction, to evaluate)")
        return []
    _say_once(f"evaluation: {count} of the {len(rows)} rows of data.train_files held out (data.val_fraction="
              f"{data_cfg.val_fraction:g}, at most data.num_val={data_cfg.num_val}, drawn by trainer.seed="
              f"{seed}); training uses the other {len(rows) - count}")
    return held_out_split(rows, count, seed)[1]


def _say_once(line: str) -> None:
    """One line from the first rank (every rank carves the same split)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def prompt_stream_from_config(data_cfg: Any, batch_size: int, seed: int, ctx: DistContext,
                              check_rows: Callable[[list[dict]], None] | None = None,
                              ) -> PromptStream | StreamingPromptStream:
    """The training prompt stream: `PromptStream` over `rows_from_config`'s rows (given to ``check_rows``
    first), or with ``data.streaming=true`` a `StreamingPromptStream` over the training files, each
    data-parallel rank of ``ctx`` reading its own share and the batch gathered over them (its rows are
    checked as they are drawn; validation rows stay loaded whole)."""
    if not data_cfg.streaming:
        rows = rows_from_config(data_cfg, "train", seed)
        if check_rows is not None:
            check_rows(rows)
        return PromptStream(rows, batch_size, seed, data_cfg.shuffle)
    if not data_cfg.train_files:
        raise DataError("data.streaming=true streams data.train_files; give them (Parquet or Arrow files, or a "
                        "save_to_disk directory), or set data.streaming=false")
    return StreamingPromptStream(
        expand_paths(data_cfg.train_files, data_cfg.split), batch_size, seed, shuffle=data_cfg.shuffle,
        shuffle_buffer=data_cfg.shuffle_buffer, rank=ctx.dp_rank, ranks=ctx.dp_size,
        gather=lambda share: _gathered_over_dp(ctx, share), kind=data_cfg.format,
        prompt_template=data_cfg.prompt_template,
        columns=ColumnNames(data_cfg.prompt_key, data_cfg.ground_truth_key, data_cfg.reward_fn_key),
        prefer=data_cfg.task if data_cfg.task in ("gsm8k", "math") else None)


def _gathered_over_dp(ctx: DistContext, share: list[dict]) -> list[dict]:
    """Every data-parallel rank's ``share``, concatenated in rank order (TP/PP peers hold the same share);
    counted as rollout traffic: they are the step's prompts."""
    if ctx.dp_size == 1:
        return share
    parts: list[Any] = [None] * ctx.dp_size
    with ctx.counted("rollout", "all_gather", over="dp") as transfer:
        transfer.payload_bytes = len(pickle.dumps(share))
        dist.all_gather_object(parts, share, group=ctx.dp_group)
    return [row for part in parts for row in part]


def reward_from_config(data_cfg: Any, device: Any = "cpu") -> RewardComputer:
    """The reward the ``data`` section asks for (`scalerl.data.rewards.computer.reward_from_config`: ``auto`` scores by
    each row's data_source, falling back to the task's built-in; a reward model runs on ``device``). A built-in
    task with a reward of its own (`TASK_REWARD_SPECS`: tool_arithmetic's final answer after the tool result)
    scores with it under ``auto``."""
    if data_cfg.reward.strip() == "auto" and getattr(data_cfg, "task", None) in TASK_REWARD_SPECS:
        data_cfg = copy.copy(data_cfg)
        data_cfg.reward = TASK_REWARD_SPECS[data_cfg.task]
    return rewards.reward_from_config(data_cfg, device)


class PromptStream:
    """Yields batches of rows forever, reshuffled each epoch from ``seed``; its position is its whole state,
    so a resumed run continues with exactly the rows an uninterrupted one would have seen."""

    def __init__(self, rows: list[dict], batch_size: int, seed: int, shuffle: bool = True,
                 batch_key: str = "trainer.batch_size"):
        if not rows:
            raise DataError("the training set is empty")
        if batch_size > len(rows):  # `batch_key` names the setting the caller took batch_size from
            raise DataError(f"{batch_key}={batch_size} exceeds the {len(rows)} training rows; lower {batch_key} "
                            "or give more data (data.num_train, data.train_files)")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.position = 0  # rows consumed so far, across epochs

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            epoch, offset = divmod(self.position, len(self.rows))
            order = self._order(epoch)
            take = min(self.batch_size - len(batch), len(self.rows) - offset)
            batch.extend(self.rows[i] for i in order[offset : offset + take])
            self.position += take
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
