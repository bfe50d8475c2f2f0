"""The example configs are valid, and the seed article's launch script maps or refuses its flags."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scalerl.bench.matrix import BenchMatrix
from scalerl.core.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "grpo_trainer" / "run_qwen2-7b_math_megatron.sh"


# Overrides a config is always run with (its header says so): these need a model directory, whose positions
# hold their prompt + response lengths where the built-in model's 512 could not.
LAUNCHED_WITH = {"qwen2-7b_math.yaml": ["model.path=/models/Qwen2-7B"],
                 "gsm8k_qwen2.yaml": ["model.path=/models/Qwen2.5-0.5B-Instruct"]}


# examples/bench/ holds `scalerl bench --matrix` files, not training configs.
BENCH_MATRICES = sorted((ROOT / "examples" / "bench").glob("*.yaml"))
TRAINING_CONFIGS = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if p not in BENCH_MATRICES)


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_example_configs_validate(path):
    load_config(path, LAUNCHED_WITH.get(path.name, []))


@pytest.mark.parametrize("path", BENCH_MATRICES, ids=lambda p: p.name)
def test_example_bench_matrices_validate(path):
    matrix = BenchMatrix.from_dict(yaml.safe_load(path.read_text()))
    matrix.check()
    assert matrix.strategies and matrix.nodes


def _run(*args):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_gradient_compression_turns_on_layer_adaptive_topk():
    done = _run("--distributed_backend", "slurm", "--num_nodes", "2", "--gpus_per_node", "8", "--batch_size", "64",
                "--gradient_compression", "True", "--print")
    assert done.returncode == 0, done.stderr
    assert "comm.gradient_compression=topk" in done.stdout and "comm.layer_adaptive=true" in done.stdout
    cfg = load_config(ROOT / "examples" / "grpo_trainer" / "tiny_arithmetic.yaml",
                      ["comm.gradient_compression=topk", "comm.layer_adaptive=true", "parallel.dp_replicate=16"])
    assert cfg.comm.gradient_compression == "topk"
    off = _run("--distributed_backend", "slurm", "--gradient_compression", "False", "--print")
    assert off.returncode == 0 and "comm.gradient_compression" not in off.stdout
    bad = _run("--distributed_backend", "slurm", "--gradient_compression", "maybe", "--print")
    assert bad.returncode == 2 and "expected True or False" in bad.stderr


def test_unknown_flag_is_an_error_not_ignored():
    done = _run("--distributed_backend", "ray", "--gradient_compression", "False", "--num_gpus", "8")
    assert done.returncode == 2 and "unknown flag '--num_gpus'" in done.stderr


def test_slurm_script_carries_the_mapped_config():
    done = _run("--distributed_backend", "slurm", "--num_nodes", "2", "--gpus_per_node", "8", "--batch_size", "64",
                "--gradient_compression", "False", "--gradient_accumulation_steps", "4", "--fp16", "True",
                "--model_path", "/models/Qwen2-7B", "--print")
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert "#SBATCH --nodes=2" in script and "gpu:8" in script
    for override in ("trainer.batch_size=64", "actor.ppo_mini_batch_size=512", "actor.ppo_micro_batch_size=8",
                     "parallel.dp_replicate=16", "trainer.precision=fp16", "model.path=/models/Qwen2-7B"):
        assert override in script, override
