"""On-policy distillation against GRPO alone on the demo's arithmetic task (docs/algorithms.md, On-policy
distillation: the demo).

1. Teacher: a larger built-in model trained as `scalerl demo` trains its model (SFT warm start on the weak
   teacher's demonstrations, 60% of them off by one, then GRPO on the exact-answer reward), exported.
2. Student: the smaller built-in model, SFT warm start on the same demonstrations (once: every arm and seed
   starts from this one checkpoint).
3. For each seed, from that SFT start: GRPO alone, and GRPO with the teacher's per-token reverse KL added
   (``algorithm.distill.teacher`` + ``task_weight=1``; ``--top-k``: the teacher's top-k forward KL instead,
   ``--task-weight``, ``--coef``), the same steps, batch and learning rate (``--lr`` sets both arms'); held-out
   accuracy (greedy, ``data.num_val`` unseen problems) every ``--eval-every`` steps.

Printed side by side: per seed and arm, the first evaluated step whose held-out accuracy reaches the target and
the training wall time to it (the sum of ``timing_s/step`` up to that step: generation, reward, the teacher's
pass where there is one, update; evaluation excluded, the same for both), with the ratio GRPO / distillation.
The target defaults to the lowest final accuracy GRPO alone reaches over the seeds (so GRPO alone reaches it in
every seed by its last step); ``--target`` fixes it.

    OMP_NUM_THREADS=1 python benchmarks/distill_demo.py [--seeds 0 1 2] [--steps 40] [--out outputs/distill_demo]

The teacher and the student's SFT are independent: ``--only teacher`` and ``--only student`` run one each (two
processes at once), and a later run with ``--reuse`` keeps every stage whose model is already under ``--out``
(an arm's run directory names its settings that differ from the defaults, so runs of other settings are not taken).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalerl.cli import DEMO_CONFIG
from scalerl.core.config import load_config
from scalerl.demo import TEACHER_ERROR_RATE, write_teacher_demonstrations

ARMS = ("grpo", "grpo+distill")


def model_overrides(hidden: int, layers: int) -> list[str]:
    """A built-in decoder of ``hidden`` width and ``layers`` layers, shaped like the demo's (head size 32, two
    query heads per key/value head, intermediate 2.75x)."""
    heads = max(hidden // 32, 2)
    return [f"model.hidden_size={hidden}", f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}",
            f"model.num_key_value_heads={max(heads // 2, 1)}", f"model.intermediate_size={int(hidden * 2.75)}"]


def curve(metrics: Path) -> tuple[list[tuple[int, float, float]], float]:
    """``[(step, held-out accuracy, training seconds up to that step)]`` from a run's metrics.jsonl (step 0: the
    start), and the median step time."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    points, seconds, step_times = [], 0.0, []
    for row in rows:
        seconds += row.get("timing_s/step", 0.0)
        if "timing_s/step" in row:
            step_times.append(row["timing_s/step"])
        if "val/accuracy" in row:
            points.append((int(row["step"]), float(row["val/accuracy"]), seconds))
    return points, statistics.median(step_times)


def _finished(metrics: Path, steps: int) -> bool:
    """A run's metrics.jsonl that reached ``steps``."""
    if not metrics.is_file():
        return False
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return bool(rows) and rows[-1].get("step") == steps and "val/accuracy" in rows[-1]


def reached(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """The first evaluated (step, seconds) at which the accuracy is >= ``target``, None if never."""
    for step, accuracy, seconds in points:
        if accuracy >= target - 1e-9:
            return step, seconds
    return None


def run_tag(args: argparse.Namespace, arm: str) -> str:
    """The part of an arm's run directory naming its settings where they differ from the defaults, so that
    ``--reuse`` under one ``--out`` never takes a run made with other settings for this one."""
    tag = "" if args.lr is None else f"_lr{args.lr:g}"
    if arm == "grpo+distill":
        if args.top_k:
            tag += f"_top{args.top_k}"
        if args.task_weight != 1.0:
            tag += f"_tw{args.task_weight:g}"
        if args.coef != 1.0:
            tag += f"_coef{args.coef:g}"
    return tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/distill_demo"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--teacher", type=int, nargs=2, default=[256, 2], metavar=("HIDDEN", "LAYERS"))
    parser.add_argument("--student", type=int, nargs=2, default=[128, 2], metavar=("HIDDEN", "LAYERS"))
    parser.add_argument("--teacher-steps", type=int, default=22, help="the teacher's GRPO steps")
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40, help="each student arm's GRPO steps")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.distill.coef")
    parser.add_argument("--top-k", type=int, default=0,
                        help="algorithm.distill.top_k: k > 0 trains on the teacher's top-k forward KL (a loss term) "
                             "instead of the sampled tokens' reverse KL (0)")
    parser.add_argument("--task-weight", type=float, default=1.0,
                        help="algorithm.distill.task_weight of the distilled arm (0: distillation alone)")
    parser.add_argument("--lr", type=float, default=None,
                        help="actor.lr of both arms (default: the demo's, 3e-5)")
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--reuse", action="store_true", help="keep the models of stages already under --out")
    parser.add_argument("--only", choices=("teacher", "student"), default=None,
                        help="run only the teacher's training or only the student's SFT, then stop")
    parser.add_argument("--arm", choices=ARMS, default=None,
                        help="train only this arm (with --reuse, a later run without --arm prints the table)")
    args = parser.parse_args()

    from scalerl.trainer.rl_trainer import train
    from scalerl.trainer.sft_trainer import train_sft

    out = args.out
    base = load_config(DEMO_CONFIG, ["trainer.logger=[jsonl]", f"sft.steps={args.sft_steps}"])
    demos = out / "data" / "demonstrations.jsonl"
    if not (args.reuse and demos.is_file()):
        write_teacher_demonstrations(base, demos, base.trainer.seed)

    def sft(name: str, size: list[int]) -> str:
        if args.reuse and (out / name / "sft" / "model" / "config.json").is_file():
            return str(out / name / "sft" / "model")
        cfg = load_config(DEMO_CONFIG, ["trainer.logger=[jsonl]", f"sft.steps={args.sft_steps}",
                                        *model_overrides(*size)])
        cfg.data.train_files, cfg.sft.output_dir = [str(demos)], str(out / name / "sft")
        return train_sft(cfg)["model_dir"]

    teacher_dir = out / "teacher" / "grpo" / "final"
    if args.only == "student":
        sft("student", args.student)
        return
    if not (args.reuse and (teacher_dir / "config.json").is_file()):
        print(f"[teacher] {args.teacher[0]} wide x {args.teacher[1]} layers: SFT {args.sft_steps} steps on "
              f"demonstrations {TEACHER_ERROR_RATE:.0%} off by one, then GRPO {args.teacher_steps} steps", flush=True)
        cfg = load_config(DEMO_CONFIG, ["trainer.logger=[jsonl]", *model_overrides(*args.teacher),
                                        f"trainer.total_steps={args.teacher_steps}"])
        cfg.trainer.init_from, cfg.trainer.output_dir = sft("teacher", args.teacher), str(out / "teacher" / "grpo")
        teacher_dir = Path(train(cfg)["final_model"])
    teacher_points, _ = curve(out / "teacher" / "grpo" / "metrics.jsonl")
    if args.only == "teacher":
        return

    print(f"[student] {args.student[0]} wide x {args.student[1]} layers: SFT {args.sft_steps} steps", flush=True)
    student_sft = sft("student", args.student)
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            run_dir = out / "student" / f"{arm}{run_tag(args, arm)}_seed{seed}"
            if args.reuse and _finished(run_dir / "metrics.jsonl", args.steps):
                points, step_s = curve(run_dir / "metrics.jsonl")
                runs[arm][seed] = {"curve": points, "median_step_s": step_s}
                continue
            if args.arm not in (None, arm):
                continue
            print(f"[seed {seed}] {arm}: {args.steps} GRPO steps", flush=True)
            overrides = ["trainer.logger=[jsonl]", *model_overrides(*args.student), f"trainer.seed={seed}",
                         f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.eval_every}",
                         "trainer.save_every=0"]
            if args.lr is not None:
                overrides.append(f"actor.lr={args.lr}")
            if arm == "grpo+distill":
                overrides += [f"algorithm.distill.teacher={teacher_dir}",
                              f"algorithm.distill.task_weight={args.task_weight}",
                              f"algorithm.distill.coef={args.coef}", f"algorithm.distill.top_k={args.top_k}"]
            cfg = load_config(DEMO_CONFIG, overrides)
            cfg.trainer.init_from, cfg.trainer.output_dir = student_sft, str(run_dir)
            train(cfg)
            points, step_s = curve(Path(cfg.trainer.output_dir) / "metrics.jsonl")
            runs[arm][seed] = {"curve": points, "median_step_s": step_s}

    if args.arm is not None:
        return
    target = args.target
    if target is None:
        target = min(run["curve"][-1][1] for run in runs["grpo"].values())
    print()
    print(f"teacher ({args.teacher[0]}x{args.teacher[1]}): held-out accuracy {teacher_points[0][1]:.1%} after SFT, "
          f"{teacher_points[-1][1]:.1%} after GRPO")
    print(f"student ({args.student[0]}x{args.student[1]}) after SFT: {runs['grpo'][args.seeds[0]]['curve'][0][1]:.1%}; "
          f"target held-out accuracy {target:.1%}")
    print(f"{'seed':>4} | {'GRPO: step':>10} {'s':>6} {'final':>6} | {'+distill: step':>14} {'s':>6} {'final':>6} | "
          f"{'steps ratio':>11} {'time ratio':>10} | {'step s':>13}")
    table = []
    for seed in args.seeds:
        g, d = runs["grpo"][seed], runs["grpo+distill"][seed]
        rg, rd = reached(g["curve"], target), reached(d["curve"], target)

        def cell(r):
            return (f"{r[0]:>10} {r[1]:>6.0f}" if r else f"{'never':>10} {'-':>6}")

        steps_ratio = rg[0] / rd[0] if rg and rd and rd[0] else None
        time_ratio = rg[1] / rd[1] if rg and rd and rd[1] else None
        def ratio(r):
            return "-" if r is None else f"{r:.2f}x"

        print(f"{seed:>4} | {cell(rg)} {g['curve'][-1][1]:>6.1%} | {cell(rd):>21} {d['curve'][-1][1]:>6.1%} | "
              f"{ratio(steps_ratio):>11} {ratio(time_ratio):>10} | "
              f"{g['median_step_s']:.2f} / {d['median_step_s']:.2f}")
        table.append({"seed": seed, "grpo": rg, "distill": rd, "steps_ratio": steps_ratio, "time_ratio": time_ratio,
                      "grpo_final": g["curve"][-1][1], "distill_final": d["curve"][-1][1]})
    result = {"target": target, "teacher": {"size": args.teacher, "curve": teacher_points},
              "student": {"size": args.student}, "steps": args.steps, "coef": args.coef,
              "top_k": args.top_k, "task_weight": args.task_weight, "lr": args.lr, "table": table,
              "runs": runs}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"curves: {out / 'result.json'}")


if __name__ == "__main__":
    main()
