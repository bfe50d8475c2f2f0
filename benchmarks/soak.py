"""Soak: the demo's GRPO at world 2 under `torchrun --max-restarts`, with a rank SIGKILLed every ~K steps,
against the same run uninterrupted (measured in the same invocation).

    python benchmarks/soak.py                                   # 300 steps, a kill every ~50, checkpoint every 10
    python benchmarks/soak.py --steps 100 --kill-every 25 --sft-steps 300   # a reduced run

1. SFT warm start on the weak teacher's demonstrations (`scalerl demo`'s first two stages, one process).
2. GRPO from it at world 2 (DDP), uninterrupted.
3. The same GRPO with a killer: whenever the run has logged the next multiple of --kill-every (plus a random
   0..save_every-1 steps), it SIGKILLs a random rank; torchrun restarts the job, which continues from the
   latest checkpoint (the default trainer.resume=never: a launcher restart continues its own run).

Prints, per kill, the step logged and the checkpoint resumed from; then steps lost (steps computed again
after a restart; target: at most --save-every per kill, which a kill during a save reaches), duplicate and
missing steps in metrics.jsonl (target 0),
whether the final weights equal the uninterrupted run's bitwise, and both runs' final held-out accuracy.
Results go to <out>/soak_result.json. Not part of the test suite (it takes long on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from scalerl.core.config import load_config
from scalerl.core.net import free_port
from scalerl.demo import write_teacher_demonstrations
from scalerl.trainer.sft_trainer import train_sft

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "scalerl" / "configs" / "demo.yaml"


def sft_warm_start(out: Path, sft_steps: int, seed: int) -> Path:
    cfg = load_config(DEMO_CONFIG, [f"sft.steps={sft_steps}", f"trainer.output_dir={out}", "trainer.logger=[jsonl]"])
    data = write_teacher_demonstrations(cfg, out / "teacher_demonstrations.jsonl", seed)
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.data.train_files = [str(data)]
    sft_cfg.sft.output_dir = str(out / "sft")
    return Path(train_sft(sft_cfg)["model_dir"])


def grpo_command(run: Path, init_from: Path, steps: int, save_every: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "--max-restarts", str(max_restarts), "-m", "scalerl", "train", str(DEMO_CONFIG),
            f"trainer.total_steps={steps}", f"trainer.save_every={save_every}", "trainer.logger=[jsonl]",
            f"trainer.init_from={init_from}", f"trainer.output_dir={run}", "trainer.overwrite=false"]


def logged_steps(run: Path) -> list[int]:
    file = run / "metrics.jsonl"
    if not file.is_file():
        return []
    steps = []
    for line in file.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return steps


def latest_checkpoint_step(run: Path) -> int:
    names = [p.name for p in (run / "checkpoints").glob("step_*") if (p / "meta.json").is_file()]
    return max((int(n.split("_")[1]) for n in names), default=0)


def workers(agent_pid: int) -> list[int]:
    """The rank processes torchrun's agent started (its children)."""
    try:
        return [int(p) for p in Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()]
    except OSError:
        return []


def run_with_kills(cmd: list[str], run: Path, steps: int, kill_every: int, save_every: int, seed: int,
                   log, timeout_s: float) -> list[dict]:
    """Run ``cmd`` (torchrun), SIGKILLing a random rank after each next multiple of ``kill_every`` steps."""
    rng = random.Random(seed)
    kills: list[dict] = []
    next_kill = kill_every + rng.randrange(save_every)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    agent = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while agent.poll() is None:
        if time.monotonic() > deadline:
            agent.kill()
            raise TimeoutError(f"the killed run did not finish within {timeout_s:g} s (log: {log.name})")
        done = logged_steps(run)
        ranks = workers(agent.pid)
        if done and done[-1] >= next_kill and next_kill < steps and len(ranks) == 2:
            victim = rng.choice(ranks)
            logged, resumable = done[-1], latest_checkpoint_step(run)
            os.kill(victim, signal.SIGKILL)
            kills.append({"logged_step": logged, "checkpoint_step": resumable, "steps_lost": logged - resumable})
            print(f"  kill {len(kills)}: SIGKILL rank pid {victim} after step {logged}; latest checkpoint: "
                  f"step {resumable}", flush=True)
            next_kill += kill_every + rng.randrange(save_every)
            while workers(agent.pid) and set(workers(agent.pid)) & set(ranks):  # wait for the restart
                time.sleep(0.2)
        time.sleep(0.2)
    if agent.returncode != 0:
        raise RuntimeError(f"the killed run failed with exit code {agent.returncode} (log: {log.name})")
    return kills


def final_accuracy(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val/accuracy"] for r in records if "val/accuracy" in r][-1]


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="GRPO steps (default 300)")
    parser.add_argument("--kill-every", type=int, default=50, help="a kill every ~N steps (default 50)")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint interval (default 10)")
    parser.add_argument("--sft-steps", type=int, default=1000, help="SFT warm-start steps (default: the demo's 1000)")
    parser.add_argument("--seed", type=int, default=0, help="chooses the kill steps and the ranks killed")
    parser.add_argument("--out", default="outputs/soak", help="scratch directory (replaced)")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600, help="limit per GRPO run")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    started = time.perf_counter()
    print(f"[1/3] SFT warm start ({args.sft_steps} steps)", flush=True)
    model = sft_warm_start(out, args.sft_steps, seed=0)
    sft_s = time.perf_counter() - started

    print(f"[2/3] GRPO {args.steps} steps at world 2, uninterrupted", flush=True)
    t0 = time.perf_counter()
    with open(out / "uninterrupted.log", "w") as log:
        done = subprocess.run(grpo_command(out / "uninterrupted", model, args.steps, args.save_every, 0),
                              env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed (log: {out / 'uninterrupted.log'})")
    straight_s = time.perf_counter() - t0

    kills_planned = max((args.steps - 1) // args.kill_every, 0)
    print(f"[3/3] GRPO {args.steps} steps at world 2, a rank killed every ~{args.kill_every} steps", flush=True)
    t0 = time.perf_counter()
    with open(out / "killed.log", "w") as log:
        kills = run_with_kills(grpo_command(out / "killed", model, args.steps, args.save_every, kills_planned + 1),
                               out / "killed", args.steps, args.kill_every, args.save_every, args.seed, log,
                               args.timeout_s)
    killed_s = time.perf_counter() - t0

    counts = Counter(logged_steps(out / "killed"))
    result = {
        "steps": args.steps, "save_every": args.save_every, "kill_every": args.kill_every, "kills": kills,
        "steps_lost": sum(k["steps_lost"] for k in kills),
        "max_steps_lost_per_kill": max((k["steps_lost"] for k in kills), default=0),
        "duplicate_steps": sorted(s for s, c in counts.items() if c > 1),
        "missing_steps": sorted(set(range(args.steps + 1)) - set(counts)),
        "final_weights_bitwise_equal": same_weights(out / "uninterrupted", out / "killed"),
        "final_accuracy_uninterrupted": final_accuracy(out / "uninterrupted"),
        "final_accuracy_killed": final_accuracy(out / "killed"),
        "seconds": {"sft": sft_s, "uninterrupted": straight_s, "killed": killed_s},
    }
    (out / "soak_result.json").write_text(json.dumps(result, indent=2))
    print(f"kills: {len(kills)}; steps lost: {result['steps_lost']} (max {result['max_steps_lost_per_kill']} per kill, "
          f"checkpoint interval {args.save_every}); duplicate steps: {len(result['duplicate_steps'])}; "
          f"missing steps: {len(result['missing_steps'])}")
    print(f"final weights bitwise equal to the uninterrupted run's: {result['final_weights_bitwise_equal']}")
    print(f"final held-out accuracy: uninterrupted {result['final_accuracy_uninterrupted']:.1%}, "
          f"killed {result['final_accuracy_killed']:.1%}")
    print(f"time: SFT {sft_s:.0f} s, uninterrupted {straight_s:.0f} s, killed {killed_s:.0f} s "
          f"(ratio {killed_s / straight_s:.2f})")
    ok = (not result["duplicate_steps"] and not result["missing_steps"]
          and result["max_steps_lost_per_kill"] <= args.save_every)  # a kill mid-save loses a whole interval
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
