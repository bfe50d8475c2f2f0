"""`scalerl plan` against measured runs on this machine: for each cell, the plan's predicted peak memory per rank
and step time beside the run's own `perf/max_memory_gb` (peak RSS on the CPU, the max over ranks) and the
median `timing_s/step` of its steps after the first, each cell run ``--repeats`` times.

    .venv/bin/python benchmarks/plan_validation.py [--repeats 2] [--steps 4] [--cells tiny,tiny-dp2,...]

Multi-rank cells run under torchrun (gloo, OMP_NUM_THREADS=1, trainer.cpu_threads=1 each). Prints one table
row per cell (predicted, measured runs, ratio predicted / measured mean) and writes plan_validation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ["data.num_train=200", "data.num_val=8", "rollout.n=4", "rollout.max_new_tokens=8", "trainer.batch_size=4",
        "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=4", "trainer.eval_every=0",
        "trainer.logger=[jsonl]", "trainer.cpu_threads=1", "trainer.overwrite=true"]
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4",
        "model.num_key_value_heads=2"]
# Qwen2.5-0.5B's layer shape (hidden 896, MLP 4864, 14 heads over 2 kv heads) at 2 layers, built-in vocabulary
HALF_B = ["model.hidden_size=896", "model.intermediate_size=4864", "model.num_attention_heads=14",
          "model.num_key_value_heads=2", "model.num_hidden_layers=2"]
CELLS = {
    "tiny": (1, TINY),
    "0.5b-shaped": (1, HALF_B),
    "tiny-dp2": (2, TINY),
    "0.5b-shaped-dp2": (2, HALF_B),
    "0.5b-shaped-fsdp2": (2, [*HALF_B, "parallel.dp_shard=2"]),
}


def run_cell(ranks: int, overrides: list[str], steps: int, out_dir: Path) -> dict:
    args = [*BASE, *overrides, f"trainer.total_steps={steps}", f"trainer.output_dir={out_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if ranks == 1:
        cmd = [sys.executable, "-m", "scalerl", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "scalerl", "train", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if "timing_s/step" in r]
    later = steps_rows[1:] or steps_rows
    return {"step_s": statistics.median(r["timing_s/step"] for r in later),
            "memory_gb": max(r.get("perf/max_memory_gb", 0.0) for r in steps_rows),
            "phases": {k: statistics.median(r.get(k, 0.0) for r in later)
                       for k in ("timing_s/gen", "timing_s/update_actor", "timing_s/old_log_prob",
                                 "timing_s/update_weights")}}


def predict(ranks: int, overrides: list[str], steps: int, out_dir: Path) -> dict:
    from scalerl.core.config import load_config
    from scalerl.plan.cli import Cluster, make_plan
    from scalerl.plan.timing import step_seconds

    args = [*BASE, *overrides, f"trainer.total_steps={steps}", f"trainer.output_dir={out_dir}"]
    cfg = load_config(None, args)
    plan = make_plan(cfg, Cluster(1, ranks, "cpu"), overrides=args, recommend=False)
    peak = max(sum(p.values()) for p in plan.memory.values()) / 2**30
    return {"step_s": step_seconds(plan.seconds), "memory_gb": peak, "seconds": plan.seconds,
            "memory": {k: sum(v.values()) / 2**30 for k, v in plan.memory.items()},
            "calibration": plan.calibration.source}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--output", default="plan_validation.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="scalerl-plan-validation-") as tmp:
        for name in args.cells.split(","):
            ranks, overrides = CELLS[name]
            predicted = predict(ranks, overrides, args.steps, Path(tmp) / f"{name}-plan")
            measured = [run_cell(ranks, overrides, args.steps, Path(tmp) / f"{name}-{i}") for i in range(args.repeats)]
            results[name] = {"ranks": ranks, "overrides": overrides, "predicted": predicted, "measured": measured}
            mem = statistics.mean(m["memory_gb"] for m in measured)
            step = statistics.mean(m["step_s"] for m in measured)
            print(f"{name:18s} ranks {ranks}  memory GiB: predicted {predicted['memory_gb']:.3f} measured "
                  f"{' / '.join(format(m['memory_gb'], '.3f') for m in measured)} ratio {predicted['memory_gb'] / mem:.2f}"
                  f"  | step s: predicted {predicted['step_s']:.3f} measured "
                  f"{' / '.join(format(m['step_s'], '.3f') for m in measured)} ratio {predicted['step_s'] / step:.2f}",
                  flush=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
