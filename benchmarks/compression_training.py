"""Gradient compression on the demo's training: gradient bytes per step and final quality, per setting.

    python benchmarks/compression_training.py [--settings none bf16 powersgd topk] [--sft-steps 1000]
        [--grpo-steps 120] [--seeds 0 1 2] [--out outputs/bench_compression]

Runs the demo (`scalerl/configs/demo.yaml`: the weak teacher's data, SFT warm start, then GRPO with the
exact-answer reward) at world 2: DDP over a spawned gloo group on loopback, one process per rank, the
same seed for every setting (each of --seeds in turn; accuracies are compared with `none` of the
same seed). Settings: `none` (dense fp32 all-reduce, the baseline measured in the same
run), `bf16`, `powersgd` and `topk` (both layer-adaptive, comm.compression_budget 0.1, dense for the
first comm.compression_start_step = 10 optimizer steps of each phase). `--sft-steps` / `--grpo-steps`
shorten the phases (defaults: the demo's own 1000 and 120; --grpo-steps 0 runs SFT only).

Printed per setting: gradient bytes each rank sent per step (SFT, GRPO) and the share saved against a
dense fp32 ring all-reduce of the same gradients, the final SFT loss (mean of the last 20 steps), held-out
accuracy after SFT and after GRPO (500 unseen problems, greedy), the difference to `none`, and the
curves (SFT loss every 10%, GRPO accuracy at each evaluation). Targets: >= 60% fewer gradient bytes than
dense fp32 (aim 90%+), final accuracy within 2 points of dense.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = 2
TARGET_SAVED, TARGET_POINTS = 0.60, 2.0


def _rank_main(rank: int, port: int, cfg_dict: dict, sft_model: str | None, out: dict) -> None:
    """SFT (unless `sft_model` is given: a dense SFT's output to start GRPO from), then GRPO."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    import copy

    import torch

    from scalerl.core.config import Config, config_from_dict
    from scalerl.trainer.rl_trainer import RLTrainer
    from scalerl.trainer.sft_trainer import train_sft

    torch.set_num_threads(1)
    cfg = config_from_dict(Config, cfg_dict)
    start = time.perf_counter()
    result = {"sft_accuracy": None, "grpo_initial": None, "grpo_final": None}
    if sft_model is None:
        sft = train_sft(copy.deepcopy(cfg))
        sft_model = sft["model_dir"]
        result["sft_accuracy"] = sft["last"].get("val/accuracy")
    sft_seconds = time.perf_counter() - start
    if cfg.trainer.total_steps > 0:
        rl_cfg = copy.deepcopy(cfg)
        rl_cfg.trainer.init_from = sft_model
        rl_cfg.trainer.output_dir = str(Path(cfg.trainer.output_dir) / "grpo")
        summary = RLTrainer.from_config(rl_cfg).fit()
        result.update(grpo_initial=summary["initial"]["val/accuracy"], grpo_final=summary["last"]["val/accuracy"])
    if rank == 0:
        out.update(result, sft_seconds=sft_seconds, seconds=time.perf_counter() - start)


def run_setting(setting: str, base: list[str], out_dir: Path, teacher_file: Path, comm: list[str],
                sft_model: str | None = None) -> dict:
    import torch.multiprocessing as mp

    from scalerl.core.config import config_to_dict, load_config
    from scalerl.core.net import free_port

    compression = [] if setting == "none" else [f"comm.gradient_compression={setting}", *comm]
    cfg = load_config(REPO / "scalerl" / "configs" / "demo.yaml", [
        *base, *compression, f"trainer.output_dir={out_dir}", f"sft.output_dir={out_dir / 'sft'}",
        f"data.train_files=[{teacher_file}]", f"parallel.dp_replicate={WORLD}", "trainer.logger=[jsonl]",
    ])
    with mp.Manager() as manager:
        result = manager.dict()
        mp.start_processes(_rank_main, args=(free_port(), config_to_dict(cfg), sft_model, result), nprocs=WORLD,
                           start_method="spawn")
        return dict(result)


def _records(path: Path) -> list[dict]:
    from scalerl.tracking.backends import read_metrics_jsonl

    return read_metrics_jsonl(path)


def summarise(setting: str, seed: int, result: dict, out_dir: Path) -> dict:
    row = {"setting": setting, "seed": seed, **result}
    phases = [("sft", out_dir / "sft" / "metrics.jsonl")] if result["sft_accuracy"] is not None else []
    if result["grpo_final"] is not None:
        phases.append(("grpo", out_dir / "grpo" / "metrics.jsonl"))
    for phase, path in phases:
        rows = [r for r in _records(path) if "comm/grad/bytes_sent" in r]
        sent = sum(r["comm/grad/bytes_sent"] for r in rows) / len(rows)
        dense = sum(r["comm/grad/dense_fp32_bytes"] for r in rows) / len(rows)
        row[f"{phase}_bytes_per_step"], row[f"{phase}_dense_bytes_per_step"] = sent, dense
        row[f"{phase}_saved"] = 1 - sent / dense
        compressed = [r for r in rows if r.get("comm/compression/active")]
        if compressed:  # after the dense warm-up: what the plan itself saves
            row[f"{phase}_saved_after_warmup"] = 1 - sum(r["comm/grad/bytes_sent"] for r in compressed) / \
                sum(r["comm/grad/dense_fp32_bytes"] for r in compressed)
        for key in ("comm/compression/budget_used", "comm/compression/bytes_fraction/sensitive",
                    "comm/compression/bytes_fraction/matrix"):
            if rows and key in rows[-1]:
                row[f"{phase}_{key.split('/', 2)[2]}"] = rows[-1][key]
        if phase == "sft":
            losses = [r["sft/loss"] for r in rows]
            row["sft_final_loss"] = sum(losses[-20:]) / len(losses[-20:])
            every = max(1, len(losses) // 10)
            row["sft_loss_curve"] = [(i + 1, round(sum(losses[i - every + 1:i + 1]) / every, 4))
                                     for i in range(every - 1, len(losses), every)]
        else:
            row["grpo_accuracy_curve"] = [(r["step"], r["val/accuracy"]) for r in _records(path)
                                          if "val/accuracy" in r]
    return row


def _pct(value) -> str:
    return f"{value:6.1%}" if value is not None else f"{'-':>6s}"


def report(rows: list[dict]) -> None:
    print("\nbytes: gradient bytes each rank sent per step, mean over the phase (warm-up included); saved: against"
          " a dense fp32 ring all-reduce of the same gradients; (after): once compression is on")
    print(f"{'setting':>9s} {'seed':>4s} {'SFT B/step':>11s} {'saved':>6s} {'(after)':>7s} {'GRPO B/step':>12s} "
          f"{'saved':>6s} {'(after)':>7s} {'SFT loss':>8s} {'SFT acc':>7s} {'GRPO acc':>8s} {'time s':>7s}")
    for r in rows:
        def num(key, fmt, width):
            return format(r[key], fmt).rjust(width) if r.get(key) is not None else "-".rjust(width)

        print(f"{r['setting']:>9s} {r['seed']:>4d} {num('sft_bytes_per_step', '.3e', 11)} {_pct(r.get('sft_saved'))} "
              f"{_pct(r.get('sft_saved_after_warmup')):>7s} {num('grpo_bytes_per_step', '.3e', 12)} "
              f"{_pct(r.get('grpo_saved'))} {_pct(r.get('grpo_saved_after_warmup')):>7s} "
              f"{num('sft_final_loss', '.4f', 8)} {_pct(r['sft_accuracy']):>7s} {_pct(r['grpo_final']):>8s} "
              f"{r['seconds']:7.0f}")
    print("\ncurves (SFT loss: step, mean of the preceding window; GRPO held-out accuracy: step, value):")
    for r in rows:
        if "sft_loss_curve" in r:
            print(f"  {r['setting']:>9s} seed {r['seed']} SFT  "
                  f"{' '.join(f'{s}:{v:.3f}' for s, v in r['sft_loss_curve'])}")
        if "grpo_accuracy_curve" in r:
            print(f"  {r['setting']:>9s} seed {r['seed']} GRPO "
                  f"{' '.join(f'{s}:{v:.3f}' for s, v in r['grpo_accuracy_curve'])}")
    _compare(rows)


def _compare(rows: list[dict]) -> None:
    """Each setting against `none` of the same seed, then the mean over seeds."""
    base = {r["seed"]: r for r in rows if r["setting"] == "none"}
    if not base:
        return
    print("\nagainst none, same seed (accuracy in points; mean over seeds, [min, max]):")
    for setting in dict.fromkeys(r["setting"] for r in rows if r["setting"] != "none"):
        mine = [r for r in rows if r["setting"] == setting and r["seed"] in base]
        saved = min(min(r.get("sft_saved", 1.0), r.get("grpo_saved", 1.0)) for r in mine)
        parts = [f"{setting}: >= {saved:.1%} fewer gradient bytes than dense fp32 (target >= {TARGET_SAVED:.0%}: "
                 f"{'met' if saved >= TARGET_SAVED else 'NOT met'})"]
        for key, label in (("sft_accuracy", "SFT accuracy"), ("grpo_final", "final accuracy")):
            diffs = [100 * (r[key] - base[r["seed"]][key]) for r in mine if r[key] is not None]
            if diffs:
                mean = sum(diffs) / len(diffs)
                verdict = f" (target within {TARGET_POINTS:g}: {'met' if mean >= -TARGET_POINTS else 'NOT met'})" \
                    if key == "grpo_final" else ""
                parts.append(f"{label} {mean:+.1f} [{min(diffs):+.1f}, {max(diffs):+.1f}]{verdict}")
        print("; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["none", "bf16", "powersgd", "topk"],
                        choices=["none", "fp16", "bf16", "powersgd", "topk"])
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--grpo-steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_compression"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--grpo-only", action="store_true",
                        help="compress GRPO only: every setting starts GRPO from the dense (none) SFT of its seed")
    parser.add_argument("--comm", nargs="*", default=[], metavar="KEY=VALUE",
                        help="comm.* overrides for the compressed settings, e.g. comm.compression_budget=0.25")
    args = parser.parse_args(argv)

    from scalerl.core.config import load_config
    from scalerl.demo import write_teacher_demonstrations

    print(f"demo at world {WORLD} (DDP, gloo, loopback): SFT {args.sft_steps} steps, GRPO {args.grpo_steps} steps, "
          f"seeds {args.seeds}; settings {' '.join(args.settings)} {' '.join(args.comm)}", flush=True)
    results = []
    for seed in args.seeds:
        base = [f"sft.steps={args.sft_steps}", f"trainer.total_steps={args.grpo_steps}", f"trainer.seed={seed}"]
        demo = load_config(REPO / "scalerl" / "configs" / "demo.yaml", base)
        seed_dir = args.out / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        # the demo's data, one file for every setting
        teacher_file = write_teacher_demonstrations(demo, seed_dir / "teacher_demonstrations.jsonl", seed)
        if args.grpo_only and args.settings[0] != "none":
            parser.error("--grpo-only starts every setting from none's SFT: list none first")
        for setting in args.settings:
            out_dir = seed_dir / setting
            shared = str(seed_dir / "none" / "sft" / "model") if args.grpo_only and setting != "none" else None
            result = run_setting(setting, base, out_dir, teacher_file, args.comm, shared)
            results.append(summarise(setting, seed, result, out_dir))
            print(f"{setting} seed {seed}: done in {result['seconds']:.0f} s", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report(results)
    print(f"\nrows: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
