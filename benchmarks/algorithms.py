"""Every advantage estimator and every policy loss on the demo task: held-out accuracy and step time.

    python benchmarks/algorithms.py [--seeds 0 1 2] [--steps 120] [--variants rloo grpo+gspo ...]
        [--set key=value ...] [--out outputs/bench_algorithms] [--json results.json] [--yes]

The demo's task and defaults (`scalerl/configs/demo.yaml`): the weak teacher's demonstrations and one SFT
warm start per seed, shared by every variant of that seed, then `--steps` RL steps from it per variant
(`scalerl train demo.yaml trainer.init_from=<that SFT model>`, one process each, as the demo's RL part).
Variants, named `<estimator>+<loss>`: the baseline `grpo+vanilla` (always run), each advantage estimator of
`scalerl.algorithms.ADVANTAGE_ESTIMATORS` with the `vanilla` loss, and each policy loss of `POLICY_LOSSES`
with the `grpo` estimator; verl's `*_vectorized` aliases are left out. `--variants` takes those names or
one registry name (`rloo`, `gspo`). `gae` trains a critic with the
config's `critic.*` defaults (the demo sets none). `--set` overrides apply to every variant (e.g.
`--set actor.loss_agg_mode=seq-mean-token-mean`).

Printed first: the runs and an estimate of the whole benchmark's time on a quiet 2-core CPU. Then one row
per variant: held-out accuracy after the RL steps (500 unseen problems, greedy), mean and per seed, its
difference to the baseline in points, and the median RL step time (seconds) against the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO_CONFIG = REPO / "scalerl" / "configs" / "demo.yaml"
BASELINE = "grpo+vanilla"
# Quiet 2-core CPU (AMD EPYC VM), the demo's defaults: SFT step and RL step, and a process's start-up.
SFT_STEP_S, RL_STEP_S, PROCESS_S = 0.03, 0.45, 8.0


def all_variants() -> list[str]:
    """The baseline, every estimator with the vanilla loss, every loss with the grpo estimator."""
    from scalerl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    estimators = [n for n in ADVANTAGE_ESTIMATORS if n != "grpo" and not n.endswith("_vectorized")]
    losses = [n for n in POLICY_LOSSES if n != "vanilla"]
    return [BASELINE, *(f"{e}+vanilla" for e in estimators), *(f"grpo+{loss}" for loss in losses)]


def variant_overrides(variant: str) -> list[str]:
    """`<estimator>+<loss>`, or one registry name (the other half stays the default: grpo, vanilla);
    `gpg` names both an estimator and a loss, so it must be written `gpg+vanilla` or `grpo+gpg`."""
    from scalerl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    estimator, _, loss = variant.partition("+")
    if not loss:
        if variant in ADVANTAGE_ESTIMATORS and variant in POLICY_LOSSES:
            raise SystemExit(f"ambiguous variant {variant!r}: write {variant}+vanilla or grpo+{variant}")
        estimator, loss = (variant, "vanilla") if variant in ADVANTAGE_ESTIMATORS else ("grpo", variant)
    if estimator not in ADVANTAGE_ESTIMATORS or loss not in POLICY_LOSSES:
        raise SystemExit(f"unknown variant {variant!r}: estimators {', '.join(ADVANTAGE_ESTIMATORS)}; "
                         f"losses {', '.join(POLICY_LOSSES)}")
    return [f"algorithm.adv_estimator={estimator}", f"actor.policy_loss={loss}"]


def estimate_seconds(n_variants: int, n_seeds: int, steps: int, sft_steps: int) -> float:
    return n_seeds * (sft_steps * SFT_STEP_S + PROCESS_S) + n_variants * n_seeds * (steps * RL_STEP_S + PROCESS_S)


def _scalerl(args: list[str], log: Path) -> int:
    """`scalerl <args>` in a process of its own, output to ``log``; its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return subprocess.run([sys.executable, "-m", "scalerl", *args], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False).returncode


def sft_model_for_seed(seed: int, base: list[str], out: Path) -> Path:
    """The demo's SFT warm start for ``seed`` (teacher data, then `scalerl sft`), reused when already there."""
    from scalerl.core.config import load_config
    from scalerl.demo import write_teacher_demonstrations

    seed_dir = out / f"seed{seed}"
    model = seed_dir / "sft" / "model"
    if (model / "model.safetensors").is_file():
        return model
    cfg = load_config(DEMO_CONFIG, [*base, f"trainer.seed={seed}"])
    teacher = write_teacher_demonstrations(cfg, seed_dir / "data" / "teacher_demonstrations.jsonl", seed)
    code = _scalerl(["sft", str(DEMO_CONFIG), *base, f"trainer.seed={seed}", f"data.train_files=[{teacher}]",
                     f"sft.output_dir={seed_dir / 'sft'}", "trainer.logger=[jsonl]"], seed_dir / "sft.log")
    if code != 0:
        raise SystemExit(f"the SFT of seed {seed} failed (exit {code}); see {seed_dir / 'sft.log'}")
    return model


def read_run(metrics: Path) -> dict:
    """Held-out accuracy before (the SFT model) and after, and the median RL step time, from metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    steps = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    return {"initial": evals[0], "final": evals[-1], "step_s": statistics.median(steps), "steps": len(steps)}


def run_variant(variant: str, seed: int, steps: int, base: list[str], sft_model: Path, out: Path) -> dict:
    """One RL run from ``sft_model``: `read_run`'s numbers, or {"error": ...} (the benchmark goes on)."""
    run_dir, log = out / f"seed{seed}" / variant, out / f"seed{seed}" / f"{variant}.log"
    code = _scalerl(["train", str(DEMO_CONFIG), *base, *variant_overrides(variant), f"trainer.seed={seed}",
                     f"trainer.total_steps={steps}", "trainer.eval_every=0", f"trainer.init_from={sft_model}",
                     f"trainer.output_dir={run_dir}", "trainer.overwrite=true", "trainer.logger=[jsonl]"], log)
    if code != 0:
        return {"error": f"exit {code}, see {log}"}
    return read_run(run_dir / "metrics.jsonl")


def table(results: dict[str, dict[int, dict]], seeds: list[int]) -> list[dict]:
    """One row per variant: accuracy mean and per seed (points), difference to the baseline, step time."""
    base = results[BASELINE]
    if any("error" in base[s] for s in seeds):
        raise SystemExit(f"the baseline {BASELINE} failed: " + "; ".join(base[s].get("error", "") for s in seeds))
    base_acc = statistics.mean(base[s]["final"] for s in seeds)
    base_step = statistics.mean(base[s]["step_s"] for s in seeds)
    rows = []
    for variant, per_seed in results.items():
        errors = [f"seed {s}: {per_seed[s]['error']}" for s in seeds if "error" in per_seed[s]]
        if errors:
            rows.append({"variant": variant, "error": "; ".join(errors)})
            continue
        acc = statistics.mean(per_seed[s]["final"] for s in seeds)
        step = statistics.mean(per_seed[s]["step_s"] for s in seeds)
        rows.append({"variant": variant, "accuracy": acc, "per_seed": {s: per_seed[s]["final"] for s in seeds},
                     "delta_points": 100 * (acc - base_acc), "step_s": step, "step_ratio": step / base_step})
    return rows


def format_table(rows: list[dict], seeds: list[int], sft: dict[int, float]) -> str:
    lines = ["| variant | held-out accuracy (mean) | per seed " + " / ".join(map(str, seeds)) +
             f" | vs {BASELINE} | RL step (s) | vs {BASELINE} |", "| --- | --- | --- | --- | --- | --- |"]
    lines.append("| SFT start | {:.1%} | {} | | | |".format(
        statistics.mean(sft[s] for s in seeds), " / ".join(f"{100 * sft[s]:.1f}" for s in seeds)))
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['variant']}` | failed: {r['error']} | | | | |")
            continue
        delta = "baseline" if r["variant"] == BASELINE else f"{r['delta_points']:+.1f} points"
        ratio = "" if r["variant"] == BASELINE else f"{r['step_ratio']:.2f}x"
        lines.append(f"| `{r['variant']}` | {r['accuracy']:.1%} | "
                     + " / ".join(f"{100 * r['per_seed'][s]:.1f}" for s in seeds)
                     + f" | {delta} | {r['step_s']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="RL steps per variant (default: the demo's)")
    p.add_argument("--variants", nargs="+", default=None,
                   help=f"default: all; {BASELINE} is always run; `<estimator>+<loss>` or one registry name")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="key=value for every run (SFT and RL)")
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_algorithms")
    p.add_argument("--json", type=Path, default=None, help="also write the table and every run's numbers here")
    p.add_argument("--yes", action="store_true", help="run without the 5-second pause after the estimate")
    args = p.parse_args(argv)

    from scalerl.core.config import load_config

    variants = [BASELINE]
    for v in args.variants or all_variants():  # spelled out (`rloo` -> `rloo+vanilla`); unknown names fail here
        full = "+".join(o.split("=")[1] for o in variant_overrides(v))
        if full not in variants:
            variants.append(full)
    cfg = load_config(DEMO_CONFIG, args.overrides)
    steps = args.steps if args.steps is not None else cfg.trainer.total_steps
    estimate = estimate_seconds(len(variants), len(args.seeds), steps, cfg.sft.steps)
    print(f"{len(variants)} variants x {len(args.seeds)} seeds x {steps} RL steps from {len(args.seeds)} SFT "
          f"warm starts ({cfg.sft.steps} steps each): about {estimate / 60:.0f} min on a quiet 2-core CPU",
          flush=True)
    if not args.yes:
        time.sleep(5)

    start = time.perf_counter()
    results: dict[str, dict[int, dict]] = {v: {} for v in variants}
    sft: dict[int, float] = {}
    for seed in args.seeds:
        model = sft_model_for_seed(seed, args.overrides, args.out)
        for v in variants:
            run = run_variant(v, seed, steps, args.overrides, model, args.out)
            results[v][seed] = run
            if "error" in run:
                print(f"seed {seed} {v:36s} failed: {run['error']}", flush=True)
                continue
            sft[seed] = run["initial"]
            print(f"seed {seed} {v:36s} held-out {run['initial']:.1%} -> {run['final']:.1%}, "
                  f"RL step {run['step_s']:.2f} s", flush=True)
    rows = table(results, args.seeds)
    print()
    print(format_table(rows, args.seeds, sft))
    print(f"\n{len(variants)} variants x seeds {args.seeds} x {steps} steps in {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"seeds": args.seeds, "steps": steps, "overrides": args.overrides,
                                         "rows": rows, "runs": results, "sft": sft}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
