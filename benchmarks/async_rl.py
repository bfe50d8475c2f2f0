"""Synchronous vs one-step asynchronous RL with one standalone rollout worker: step time and the
reward / held-out accuracy curve, same seed.

    python benchmarks/async_rl.py [--steps 120] [--sft-steps 1000] [--batch-size 64] [--json FILE]

The demo's configuration (built-in model and task): an SFT warm start on the weak teacher's data (cached in
outputs/bench_async_rl/sft), then GRPO with one trainer rank and one rollout worker rank (world 2, gloo on
loopback, one thread each), `rollout.staleness=0` and `=1`. Each run reports the median step time (after
the first two steps), the final held-out accuracy and the score curve. The ratio printed is the
synchronous median step time over the asynchronous one (target >= 1.3x where generation and update take
similar time). `--rollout-dtype bf16` runs the worker in bf16, as deployments do; its log-probs are then
recomputed by the trainer in both modes. `--stale-logprobs behavior` makes the asynchronous run take PPO's
ratio against the rollout's own fp32 log-probs (`rollout.stale_logprobs`), skipping the recompute.
`--batch-size` sets the prompts per step (the demo's 64).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.spawned_group import run_in_group  # noqa: E402

OUT = ROOT / "outputs" / "bench_async_rl"


def _demo_config(extra: list[str]):
    from scalerl.core.config import load_config

    return load_config(ROOT / "scalerl" / "configs" / "demo.yaml", ["trainer.logger=[jsonl]", *extra])


def warm_start(sft_steps: int) -> Path:
    """The demo's SFT phase on the weak teacher's demonstrations (reused when already there)."""
    model = OUT / f"sft{sft_steps}" / "model"
    if (model / "model.safetensors").is_file():
        return model
    from scalerl.demo import write_teacher_demonstrations
    from scalerl.trainer.sft_trainer import train_sft

    cfg = _demo_config([f"sft.steps={sft_steps}", f"trainer.output_dir={OUT}", f"sft.output_dir={model.parent}"])
    cfg.data.train_files = [str(write_teacher_demonstrations(cfg, OUT / "teacher.jsonl", 0))]
    return Path(train_sft(cfg)["model_dir"])


def _grpo(rank: int, sft_model: str, steps: int, staleness: int, batch_size: int, rollout_dtype: str,
          stale_logprobs: str, sync_mode: str) -> None:
    from scalerl.trainer.rl_trainer import train

    cfg = _demo_config([])
    sequences = batch_size * cfg.rollout.n
    mini = min(cfg.actor.ppo_mini_batch_size, sequences)
    train(_demo_config([
        f"trainer.init_from={sft_model}", f"trainer.total_steps={steps}", "trainer.eval_every=10",
        "rollout.placement=standalone", f"rollout.staleness={staleness}", "trainer.overwrite=true",
        f"trainer.batch_size={batch_size}", f"actor.ppo_mini_batch_size={mini}",
        f"actor.ppo_micro_batch_size={min(cfg.actor.ppo_micro_batch_size, mini)}",
        f"rollout.dtype={rollout_dtype}",
        f"weight_sync.mode={sync_mode}",
        f"trainer.output_dir={_run_dir(staleness, batch_size, rollout_dtype, stale_logprobs, sync_mode)}",
        *([f"rollout.stale_logprobs={stale_logprobs}"] if staleness else []),
    ]))


def _run_dir(staleness: int, batch_size: int, rollout_dtype: str, stale_logprobs: str, sync_mode: str) -> Path:
    suffix = f"-{stale_logprobs}" if staleness and stale_logprobs != "recompute" else ""
    suffix += "" if sync_mode == "delta" else f"-{sync_mode}"
    return OUT / f"batch{batch_size}-{rollout_dtype}" / f"staleness{staleness}{suffix}"


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    times = [r["timing_s/step"] for r in steps[2:]]
    return {
        "median_step_s": statistics.median(times),
        "final_accuracy": next(r["val/accuracy"] for r in reversed(rows) if "val/accuracy" in r),
        "initial_accuracy": rows[0].get("val/accuracy"),
        "score_curve": [round(r["critic/score/mean"], 4) for r in steps],
        "median_gen_s": statistics.median(r["timing_s/gen"] for r in steps[2:]),
        "median_update_s": statistics.median(r["timing_s/update_actor"] for r in steps[2:]),
        "median_old_log_prob_s": statistics.median(r["timing_s/old_log_prob"] for r in steps[2:]),
        "median_update_weights_s": statistics.median(r["timing_s/update_weights"] for r in steps[2:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="GRPO steps per run (the demo's 120)")
    parser.add_argument("--sft-steps", type=int, default=1000, help="SFT warm-start steps (the demo's 1000)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per step (the demo's 64)")
    parser.add_argument("--rollout-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="the rollout worker's weights (bf16: as deployments run them; its log-probs are then "
                             "recomputed in both modes)")
    parser.add_argument("--stale-logprobs", default="recompute", choices=("recompute", "behavior"),
                        help="the asynchronous run's rollout.stale_logprobs (behavior: PPO's ratio against the "
                             "rollout's own fp32 log-probs, no recompute)")
    parser.add_argument("--weight-sync", default="delta", choices=("delta", "full", "auto"),
                        help="weight_sync.mode of both runs (full: dense pushes, cheaper in time than encoding "
                             "deltas when the worker is on the same host)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    sft_model = warm_start(args.sft_steps)
    results = {}
    for staleness in (0, 1):
        run_in_group(_grpo, 2, str(sft_model), args.steps, staleness, args.batch_size, args.rollout_dtype,
                     args.stale_logprobs, args.weight_sync, timeout_s=3600)
        results[f"staleness={staleness}"] = summarize(_run_dir(staleness, args.batch_size, args.rollout_dtype,
                                                                   args.stale_logprobs, args.weight_sync))
    for name, r in results.items():
        print(f"{name}: median step {r['median_step_s']:.3f} s (gen {r['median_gen_s']:.3f} s, old log-probs "
              f"{r['median_old_log_prob_s']:.3f} s, update {r['median_update_s']:.3f} s, weight sync "
              f"{r['median_update_weights_s']:.3f} s), held-out accuracy {r['initial_accuracy']:.3f} -> "
              f"{r['final_accuracy']:.3f}")
    ratio = results["staleness=0"]["median_step_s"] / results["staleness=1"]["median_step_s"]
    print(f"step time, synchronous / one-step asynchronous: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
