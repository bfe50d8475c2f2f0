"""What the restart tests share: a reward that kills its own rank once, mid-run, and the comparisons."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

KILLING_REWARD = '''\
import os
import signal
from pathlib import Path

CHECKPOINT, MARKER, RANK = {checkpoint!r}, {marker!r}, {rank!r}


def score(response, ground_truth):
    """Response length (varies within a group, so GRPO learns), and, once the checkpoint CHECKPOINT exists,
    a SIGKILL of rank RANK's own process the first time (MARKER remembers it)."""
    if CHECKPOINT and os.environ.get("RANK") == RANK and Path(CHECKPOINT).is_dir() and not Path(MARKER).exists():
        Path(MARKER).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return len(response) / 10
'''


def write_reward(file: Path, kill_after: Path | None = None, rank: int = 1) -> str:
    """A reward file; with ``kill_after`` (a checkpoint directory) it kills ``rank`` once that exists.
    Returns the ``data.reward`` override."""
    marker = file.with_suffix(".killed")
    file.write_text(KILLING_REWARD.format(checkpoint=str(kill_after) if kill_after else "", marker=str(marker),
                                          rank=str(rank)))
    return f"data.reward={file}:score"


def assert_same_final_weights(reference: Path, restarted: Path) -> None:
    a = load_file(str(reference / "final" / "model.safetensors"))
    b = load_file(str(restarted / "final" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def logged_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
