"""The demo's GRPO stage on vLLM beside the built-in engine: `scalerl demo trainer.seed=S` as it is (SFT warm
start, then GRPO with the built-in engine), then its GRPO stage again from the same SFT model with
`rollout.engine=vllm` (colocated): held-out accuracy before/after, gains, and median step/generation times of
both, with the ratio vLLM / built-in. Run it with the vLLM environment; one seed per call keeps each in a
fresh process.

    OMP_NUM_THREADS=2 python benchmarks/demo_engines.py --seed 0 [--out outputs/demo_engines] [--kv-gib 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
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
    """Held-out accuracy first/last, median step and generation times over steps 3 onwards, wall seconds."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    accuracy = [r["val/accuracy"] for r in rows if "val/accuracy" in r]

    def median(key: str) -> float:
        return round(statistics.median([r[key] for r in rows if key in r][2:]), 3)

    return {"before": round(accuracy[0], 3), "after": round(accuracy[-1], 3),
            "gain_points": round(100 * (accuracy[-1] - accuracy[0]), 1),
            "step_s": median("timing_s/step"), "gen_s": median("timing_s/gen"), "grpo_wall_s": round(seconds),
            "accuracy": [round(a, 3) for a in accuracy]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo_engines"))
    parser.add_argument("--kv-gib", type=float, default=1.0)
    args = parser.parse_args()

    out = args.out / f"seed{args.seed}"
    cfg = load_config(DEMO_CONFIG, [f"trainer.output_dir={out}", f"trainer.seed={args.seed}",
                                    "trainer.logger=[jsonl]"])
    demo = run_demo(cfg)
    builtin_s = demo["total_seconds"] - demo["sft_seconds"]
    vllm_cfg = copy.deepcopy(cfg)
    vllm_cfg.trainer.init_from = str(out / "sft" / "model")
    vllm_cfg.trainer.output_dir = str(out / "grpo_vllm")
    vllm_cfg.rollout.engine = "vllm"
    vllm_cfg.rollout.vllm_kv_cache_gib = args.kv_gib
    vllm_cfg.validate()
    start = time.perf_counter()
    train(vllm_cfg)
    vllm_s = time.perf_counter() - start
    builtin = summarize(out / "grpo" / "metrics.jsonl", builtin_s)
    vllm = summarize(out / "grpo_vllm" / "metrics.jsonl", vllm_s)
    result = {"seed": args.seed, "builtin": builtin, "vllm": vllm,
              "step_ratio_vllm_over_builtin": round(vllm["step_s"] / builtin["step_s"], 2),
              "gen_ratio_vllm_over_builtin": round(vllm["gen_s"] / builtin["gen_s"], 2)}
    print(json.dumps(result, indent=2))
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
