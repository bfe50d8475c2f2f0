"""The demo's GRPO stage on vLLM beside the built-in engine: `scalerl demo trainer.seed=S` as it is (SFT warm
start, then GRPO with the built-in engine), then its GRPO stage again from the same SFT model with
`rollout.engine=vllm`, per ``--placements``: ``colocated`` (vLLM beside the trainer) and/or ``standalone``
(one trainer rank + one rollout worker under torchrun, ``rollout.placement=standalone rollout.workers=1``,
run twice: the worker on the built-in engine, then on vLLM). Held-out accuracy before/after, gains, median
step/generation times, with the ratio vLLM / built-in; for every vLLM run also the evidence that each
step's weights reached vLLM verified (the steps that synced, full pushes, resent buckets). Run it with the
vLLM environment; one seed per call keeps each in a fresh process.

    OMP_NUM_THREADS=2 python benchmarks/demo_engines.py --seed 0 [--placements colocated,standalone]
                                                        [--out outputs/demo_engines] [--kv-gib 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalerl.cli import DEMO_CONFIG
from scalerl.core.config import load_config
from scalerl.demo import run_demo
from scalerl.trainer.rl_trainer import train


def summarize(metrics: Path, seconds: float) -> dict:
    """Held-out accuracy first/last, median step and generation times over steps 3 onwards, wall seconds, and
    the weight sync of every step: how many steps synced bytes to the engine (a vLLM load checks every bucket's
    checksum in the engine's process and raises on a mismatch; a standalone push is acknowledged per bucket by
    checksum, and a failed one is resent: ``weight_sync/resyncs``)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    accuracy = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "timing_s/step" in r]

    def median(key: str) -> float:
        return round(statistics.median([r[key] for r in rows if key in r][2:]), 3)

    return {"before": round(accuracy[0], 3), "after": round(accuracy[-1], 3),
            "gain_points": round(100 * (accuracy[-1] - accuracy[0]), 1),
            "step_s": median("timing_s/step"), "gen_s": median("timing_s/gen"), "grpo_wall_s": round(seconds),
            "accuracy": [round(a, 3) for a in accuracy], "steps": len(steps),
            "steps_synced": sum(r.get("comm/weight_sync_bytes", 0) > 0 for r in steps),
            "full_pushes": sum(r.get("weight_sync/full_push", 0) > 0 for r in steps),
            "resyncs": sum(r.get("weight_sync/resyncs", 0) for r in steps),
            "logprob_diff_max": max((r.get("rollout/logprob_diff/max", 0.0) for r in steps), default=0.0)}


def evaluate_final(model_dir: Path, overrides: list[str]) -> float:
    """Held-out accuracy of a saved model, evaluated as the demo evaluates, by a fresh trainer in this process.
    The standalone runs' own in-run evaluation is not taken: it reported the SFT model's accuracy (28-35%)
    where their final models score 66% (seed 0), so the trainer's evaluation engine did not see the
    updates there (a bug outside this benchmark, reported)."""
    import tempfile

    from scalerl.trainer.rl_trainer import RLTrainer

    cfg = load_config(DEMO_CONFIG, [*overrides, f"trainer.init_from={model_dir}",
                                    f"trainer.output_dir={tempfile.mkdtemp(prefix='demo_eval_')}", "trainer.logger=[]"])
    trainer = RLTrainer.from_config(cfg)
    accuracy = trainer.evaluate()["val/accuracy"]
    trainer.close()
    return round(accuracy, 3)


def run_standalone(overrides: list[str], timeout_s: float) -> float:
    """The demo's GRPO stage with one trainer rank and one rollout worker (torchrun, 2 processes); seconds."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "scalerl", "train",
               str(DEMO_CONFIG), *overrides, "rollout.placement=standalone", "rollout.workers=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"standalone run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo_engines"))
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--placements", default="colocated", help="colocated and/or standalone, comma-separated")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per standalone run")
    parser.add_argument("--standalone-engines", default="builtin,vllm",
                        help="standalone: the workers' engines to run (the ratios need both)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep what an earlier call left in --out for this seed: its SFT and built-in demo "
                             "(demo_result.json) and any standalone run that finished (final/)")
    args = parser.parse_args()
    placements = args.placements.split(",")
    if not set(placements) <= {"colocated", "standalone"}:
        parser.error(f"--placements {args.placements!r}: give colocated and/or standalone")

    out = args.out / f"seed{args.seed}"
    base = [f"trainer.output_dir={out}", f"trainer.seed={args.seed}", "trainer.logger=[jsonl]"]
    cfg = load_config(DEMO_CONFIG, base)
    if args.reuse and (out / "demo_result.json").exists():
        demo = json.loads((out / "demo_result.json").read_text())
    else:
        demo = run_demo(cfg)
    builtin = summarize(out / "grpo" / "metrics.jsonl", demo["total_seconds"] - demo["sft_seconds"])
    result = {"seed": args.seed, "builtin": builtin}
    if "colocated" in placements:
        vllm_cfg = copy.deepcopy(cfg)
        vllm_cfg.trainer.init_from = str(out / "sft" / "model")
        vllm_cfg.trainer.output_dir = str(out / "grpo_vllm")
        vllm_cfg.rollout.engine = "vllm"
        vllm_cfg.rollout.vllm_kv_cache_gib = args.kv_gib
        vllm_cfg.validate()
        start = time.perf_counter()
        train(vllm_cfg)
        vllm = summarize(out / "grpo_vllm" / "metrics.jsonl", time.perf_counter() - start)
        result.update(vllm=vllm, step_ratio_vllm_over_builtin=round(vllm["step_s"] / builtin["step_s"], 2),
                      gen_ratio_vllm_over_builtin=round(vllm["gen_s"] / builtin["gen_s"], 2))
    if "standalone" in placements:
        for engine in args.standalone_engines.split(","):
            run_dir = out / f"grpo_standalone_{engine}"
            if args.reuse and (run_dir / "final").exists():  # its wall time: the sum of its steps
                seconds = sum(json.loads(line).get("timing_s/step", 0.0)
                              for line in (run_dir / "metrics.jsonl").read_text().splitlines())
            else:
                seconds = run_standalone([*base, f"trainer.init_from={out / 'sft' / 'model'}",
                                          f"trainer.output_dir={run_dir}", f"rollout.engine={engine}",
                                          f"rollout.vllm_kv_cache_gib={args.kv_gib}"], args.timeout)
            summary = summarize(run_dir / "metrics.jsonl", seconds)
            summary["in_run_after"] = summary.pop("after")
            summary["after"] = evaluate_final(run_dir / "final", base)  # a fresh evaluation of the final model
            summary["gain_points"] = round(100 * (summary["after"] - summary["before"]), 1)
            result[f"standalone_{engine}"] = summary
            print(f"standalone {engine}: {json.dumps(result[f'standalone_{engine}'])}", flush=True)
        sb, sv = result.get("standalone_builtin"), result.get("standalone_vllm")
    if "standalone" in placements and sb and sv:
        result.update(standalone_step_ratio_vllm_over_builtin=round(sv["step_s"] / sb["step_s"], 2),
                      standalone_gen_ratio_vllm_over_builtin=round(sv["gen_s"] / sb["gen_s"], 2))
    print(json.dumps(result, indent=2))
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
