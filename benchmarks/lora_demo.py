"""The demo with LoRA beside the full fine-tune: `scalerl demo` as it is (SFT warm start, then GRPO on the
whole model), then its GRPO stage again from the same SFT model with adapters (rank 8, alpha 16,
all-linear, actor.lr 3e-4 unless given): held-out accuracy and median step times of both.

    OMP_NUM_THREADS=1 python benchmarks/lora_demo.py [--lr 3e-4] [--rank 8] [--out outputs/lora_demo]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalerl.cli import DEMO_CONFIG
from scalerl.core.config import load_config
from scalerl.demo import run_demo
from scalerl.trainer.rl_trainer import train


def medians(metrics: Path) -> dict[str, float]:
    """Median step, generation and update times over steps 3 onwards, and the held-out accuracy curve."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    def median(key: str) -> float:
        return round(statistics.median([r[key] for r in rows if key in r][2:]), 3)

    return {"step_s": median("timing_s/step"), "gen_s": median("timing_s/gen"),
            "update_s": median("timing_s/update_actor"),
            "accuracy": [round(r["val/accuracy"], 3) for r in rows if "val/accuracy" in r]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("outputs/lora_demo"))
    args = parser.parse_args()

    cfg = load_config(DEMO_CONFIG, [f"trainer.output_dir={args.out}", "trainer.logger=[jsonl]"])
    run_demo(cfg)
    lora_cfg = copy.deepcopy(cfg)
    lora_cfg.trainer.init_from = str(args.out / "sft" / "model")
    lora_cfg.trainer.output_dir = str(args.out / "grpo_lora")
    lora_cfg.model.lora.rank, lora_cfg.model.lora.alpha = args.rank, 2.0 * args.rank
    lora_cfg.actor.lr = args.lr
    lora_cfg.validate()
    train(lora_cfg)
    result = {"full": medians(args.out / "grpo" / "metrics.jsonl"),
              "lora": {"rank": args.rank, "lr": args.lr, **medians(args.out / "grpo_lora" / "metrics.jsonl")}}
    print(json.dumps(result, indent=2))
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
