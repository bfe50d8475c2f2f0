"""Step time of the demo's GRPO configuration on a quiet machine and beside other CPU-bound processes, with
torch's thread count fixed or following the free cores (`trainer.cpu_threads=0`, the default).

    python benchmarks/busy_machine.py [--steps 8] [--busy 0,1,2] [--json FILE]

Each cell runs `--steps` GRPO steps of the demo config (built-in model, 64 prompts x 8 samples) in a fresh
process and reports the median step time after the first step. "Busy" processes are plain Python loops
(one core each), started before the run and stopped after it. Printed ratios compare each cell with the
quiet machine at the default thread count in the same run; targets (issue "Reliability"): no slower than
fixed threads when quiet, at most 1.5x the quiet time beside one busy process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP_SCRIPT = r"""
import json, sys, tempfile, time
import torch
from scalerl.core.config import load_config
from scalerl.trainer.rl_trainer import RLTrainer
steps, threads = int(sys.argv[1]), int(sys.argv[2])
out = tempfile.mkdtemp()
cfg = load_config("scalerl/configs/demo.yaml", [f"trainer.cpu_threads={threads}", "trainer.logger=[]",
                  "data.num_val=0", f"trainer.total_steps={steps}", f"trainer.output_dir={out}"])
trainer = RLTrainer.from_config(cfg)
times, used = [], []
for _ in range(steps):
    start = time.perf_counter()
    m = trainer.advance()
    times.append(time.perf_counter() - start)
    used.append(m["perf/cpu_threads"])
print(json.dumps({"times": times, "threads": used}))
"""


def _spin() -> None:
    while True:
        pass


def run_cell(steps: int, threads: int, busy: int, timeout_s: float) -> dict:
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run([sys.executable, "-c", STEP_SCRIPT, str(steps), str(threads)], capture_output=True,
                              text=True, timeout=timeout_s, env=env, cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"median_s": float("inf"), "threads": None, "note": f"did not finish {steps} steps in {timeout_s:.0f} s"}
    finally:
        for p in spinners:
            p.kill()
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"median_s": statistics.median(result["times"][1:]), "threads": result["threads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--busy", default="0,1,2", help="numbers of busy processes beside the run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell before it is given up")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average before: {os.getloadavg()[0]:.2f}", flush=True)
    modes = {"follow free cores (default)": 0, "fixed 2 threads": 2, "fixed 1 thread": 1}
    rows = []
    for busy in [int(b) for b in args.busy.split(",")]:
        for name, threads in modes.items():
            cell = run_cell(args.steps, threads, busy, args.timeout)
            rows.append({"busy": busy, "mode": name, **cell})
            print(f"busy={busy} {name:28} median step {cell['median_s']:.3f} s  threads used {cell['threads']}",
                  flush=True)
            time.sleep(2)  # let the load average settle between cells
    quiet = next(r["median_s"] for r in rows if r["busy"] == 0 and r["mode"].startswith("follow"))
    print("\nratio to the quiet machine at the default:")
    for r in rows:
        print(f"  busy={r['busy']} {r['mode']:28} {r['median_s'] / quiet:5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
