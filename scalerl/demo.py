"""`scalerl demo`: the whole product on a CPU in minutes, with no downloads.

1. A weak teacher writes demonstrations for the built-in arithmetic task: most of its final answers are
   off by one (as distillation data from a weaker model is systematically wrong in places).
2. SFT warm-starts the built-in tiny model on those demonstrations: it learns the format and, faithfully,
   the teacher's mistakes.
3. GRPO then trains on the same kind of prompts with the exact-answer reward, which the teacher never saw,
   and held-out accuracy (greedy, on problems never trained on) rises well above the SFT checkpoint's.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

from scalerl.core.config import Config
from scalerl.data.arithmetic import make_arithmetic_rows

# Share of the teacher's demonstrations whose final answer is off by one.
TEACHER_ERROR_RATE = 0.6


def weak_teacher_rows(rows: list[dict], error_rate: float, seed: int) -> list[dict]:
    """Copies of ``rows`` whose SFT ``response`` ends in ``#### answer+1`` with probability ``error_rate``.
    ``ground_truth`` stays correct: rewards are always computed against the truth."""
    rng = random.Random(f"weak-teacher:{seed}")
    out = []
    for row in rows:
        row = {k: row[k] for k in ("prompt", "response", "ground_truth")}
        if rng.random() < error_rate:
            work = row["response"].rsplit("#### ", 1)[0]
            row["response"] = f"{work}#### {int(row['ground_truth']) + 1}"
        out.append(row)
    return out


def write_teacher_demonstrations(cfg: Config, path: Path, seed: int) -> Path:
    """The weak teacher's demonstrations for ``cfg``'s task (``data.num_train`` rows), as JSON lines at ``path``."""
    rows = weak_teacher_rows(make_arithmetic_rows("train", cfg.data.num_train, list(cfg.data.difficulty), seed),
                             TEACHER_ERROR_RATE, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _say(text: str) -> None:
    print(text, flush=True)


def run_demo(cfg: Config) -> dict[str, Any]:
    from scalerl.trainer.rl_trainer import train
    from scalerl.trainer.run_checks import check_run_inputs
    from scalerl.trainer.sft_trainer import train_sft

    check_run_inputs(cfg)  # before the teacher writes anything; each run checks its own config again
    start = time.perf_counter()
    out = Path(cfg.trainer.output_dir)
    seed = cfg.trainer.seed
    _say(f"scalerl demo -> {out}/")
    _say(f"[1/3] weak teacher: {cfg.data.num_train} arithmetic demonstrations (levels {cfg.data.difficulty}), "
         f"{TEACHER_ERROR_RATE:.0%} with an off-by-one answer")
    teacher_file = write_teacher_demonstrations(cfg, out / "data" / "teacher_demonstrations.jsonl", seed)

    _say(f"[2/3] SFT warm start: {cfg.sft.steps} steps of {cfg.sft.batch_size} demonstrations")
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.data.train_files = [str(teacher_file)]
    sft_cfg.sft.output_dir = str(out / "sft")
    sft = train_sft(sft_cfg)
    sft_time = time.perf_counter() - start

    _say(f"[3/3] GRPO: {cfg.trainer.total_steps} steps x {cfg.trainer.batch_size} prompts x {cfg.rollout.n} samples, "
         "reward = exact answer")
    rl_cfg = copy.deepcopy(cfg)
    rl_cfg.trainer.init_from = sft["model_dir"]
    rl_cfg.trainer.output_dir = str(out / "grpo")
    summary = train(rl_cfg)
    before = summary["initial"]["val/accuracy"]
    after = summary["last"]["val/accuracy"]
    total = time.perf_counter() - start
    result = {
        "heldout_accuracy_sft": before,
        "heldout_accuracy_grpo": after,
        "gain_points": 100 * (after - before),
        "sft_seconds": sft_time,
        "total_seconds": total,
        "final_model": summary["final_model"],
        "metrics": str(out / "grpo" / "metrics.jsonl"),
        "plot": summary.get("plot"),
    }
    (out / "demo_result.json").write_text(json.dumps(result, indent=2))
    _say("")
    _say(f"held-out accuracy after SFT : {before:6.1%}")
    _say(f"held-out accuracy after GRPO: {after:6.1%}   ({result['gain_points']:+.1f} points)")
    _say(f"time: SFT {sft_time:.0f} s, total {total:.0f} s")
    _say(f"metrics: {result['metrics']} | plot: {result['plot']} | model: {result['final_model']}")
    return result
