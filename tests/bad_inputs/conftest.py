"""Shared pieces of the bad-input corpus: a small model directory, a snapshot of every file a case could
touch, and one in-process run of the CLI that returns (exit code, stderr)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from scalerl.cli import main
from tests.tiny import tiny_overrides, tiny_run_model

# Small and fast: one RL step of the built-in task, or a model directory of the same size.
TINY = tiny_overrides("data.num_train=64", "rollout.max_new_tokens=4", "actor.ppo_mini_batch_size=8",
                      "actor.ppo_micro_batch_size=8", "trainer.total_steps=1", "sft.steps=1", "sft.micro_batch_size=8")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A Hugging Face directory of the built-in model (hidden 32, 4 heads, 2 kv heads, 2 layers, 512
    positions) with the built-in tokenizer's files; cases corrupt copies of it, never the original."""
    from scalerl.models.hf_checkpoint import save_pretrained
    from scalerl.models.tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    model = tiny_run_model(tokenizer)
    path = tmp_path_factory.mktemp("model") / "tiny"
    save_pretrained(model, path)
    tokenizer.save_pretrained(path)
    return path


def copy_model(model_dir: Path, workspace: Path, name: str = "model") -> Path:
    target = workspace / name
    shutil.copytree(model_dir, target)
    return target


def snapshot(*roots: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `roots`: path -> (size, mtime in ns, sha256)."""
    files = {}
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            stat = path.stat()
            files[str(path)] = (stat.st_size, stat.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return files


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """`scalerl <argv>` in this process: (exit code, stderr)."""
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err
