"""On-policy distillation against GRPO alone on the demo's arithmetic task (docs/algorithms.md, On-policy
distillation: the demo).

1. Teacher: a larger built-in model (``--teacher HIDDEN LAYERS``) trained as `scalerl demo` trains its model: SFT
   warm start (``--teacher-sft-steps``, default ``--sft-steps``) on demonstrations of which ``--teacher-error-rate``
   (default ``--error-rate``, 60%) are off by one, then GRPO on the exact-answer reward (``--teacher-steps``; 0:
   the teacher is its SFT model), exported.
2. Student: the smaller built-in model (``--student``), SFT warm start (``--sft-steps``) on demonstrations of
   which ``--error-rate`` are off by one (once: every arm and seed starts from this one checkpoint).
3. For each seed, from that SFT start: GRPO alone, and GRPO with the teacher's per-token reverse KL added
   (``algorithm.distill.teacher`` + ``task_weight=1``; ``--top-k``: the teacher's top-k forward KL instead,
   ``--task-weight``, ``--coef``), the same batch, and by default the same steps and learning rate (``--steps``,
   ``--lr``: one value sets both arms', two are GRPO alone's then the distilled arm's); held-out accuracy (greedy,
   ``data.num_val`` unseen problems) every ``--eval-every`` steps.

The task is the demo's (``scalerl/configs/demo.yaml``: levels 1-2 of the built-in arithmetic) unless
``--difficulty`` (``data.difficulty``; levels 3-4 write a scratchpad and need ``--max-new-tokens 20``),
``--num-train`` or ``--num-val`` change it; every stage trains and evaluates on that task.

Printed side by side: per seed and arm, the first evaluated step whose held-out accuracy reaches the target and
the training wall time to it (the sum of ``timing_s/step`` up to that step: generation, reward, the teacher's
pass where there is one, update; evaluation excluded, the same for both), with the ratio GRPO / distillation.
The target defaults to the lowest final accuracy GRPO alone reaches over the seeds (so GRPO alone reaches it in
every seed by its last step); ``--target`` fixes it; ``--target-gain G`` makes it per seed that seed's SFT start
(step 0) + G, as each seed draws its own held-out problems. An arm that never reaches it prints "never in N (T s)"
(its whole run) and the ratio is then a bound: ">" when GRPO alone never reaches it (it would after step N, if
ever), "<" when the distilled arm never does. The teacher's held-out accuracy is printed (measured on the same
problems as the arms').

    OMP_NUM_THREADS=1 python benchmarks/distill_demo.py [--seeds 0 1 2] [--steps 40] [--out outputs/distill_demo]

The teacher and the student's SFT are independent: ``--only teacher`` and ``--only student`` run one each (two
processes at once), ``--arm grpo`` needs no teacher (it can run beside ``--only teacher``), and a later run with
``--reuse`` keeps every stage whose model is already under ``--out`` (an arm's run directory names its settings
that differ from the defaults, its steps and evaluation interval included, so runs of other settings are not
taken; ``--out``'s ``settings.json`` records the task, sizes, steps and error rates, and ``--reuse`` refuses an
``--out`` made with others).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalerl.cli import DEMO_CONFIG
from scalerl.core.config import load_config
from scalerl.data.arithmetic import make_arithmetic_rows
from scalerl.demo import TEACHER_ERROR_RATE, weak_teacher_rows

ARMS = ("grpo", "grpo+distill")
DEFAULT_STEPS, DEFAULT_EVAL_EVERY = 40, 5
# The trainer logs accuracies (k / data.num_val) as float32: 43.6% reads 0.43599998..., under a target of
# 0.386... + 0.05 computed in float64; far under one problem's share of any held-out set (1/500 here).
ACCURACY_TOLERANCE = 1e-6


def model_overrides(hidden: int, layers: int) -> list[str]:
    """A built-in decoder of ``hidden`` width and ``layers`` layers, shaped like the demo's (head size 32, two
    query heads per key/value head, intermediate 2.75x)."""
    heads = max(hidden // 32, 2)
    return [f"model.hidden_size={hidden}", f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}",
            f"model.num_key_value_heads={max(heads // 2, 1)}", f"model.intermediate_size={int(hidden * 2.75)}"]


def task_overrides(args: argparse.Namespace) -> list[str]:
    """The task's overrides of the demo's config, shared by every stage (teacher, student, arms)."""
    overrides = ["trainer.logger=[jsonl]"]
    if args.difficulty is not None:
        overrides.append(f"data.difficulty=[{','.join(str(level) for level in args.difficulty)}]")
    if args.num_train is not None:
        overrides.append(f"data.num_train={args.num_train}")
    if args.num_val is not None:
        overrides.append(f"data.num_val={args.num_val}")
    if args.max_new_tokens is not None:
        overrides.append(f"rollout.max_new_tokens={args.max_new_tokens}")
    return overrides


def write_demonstrations(cfg, path: Path, error_rate: float, seed: int) -> Path:
    """``cfg``'s training problems (``data.num_train`` of ``data.difficulty``) as SFT demonstrations whose final
    answer is off by one with probability ``error_rate`` (`scalerl.demo.weak_teacher_rows`; 0: all correct)."""
    rows = weak_teacher_rows(make_arithmetic_rows("train", cfg.data.num_train, list(cfg.data.difficulty), seed),
                             error_rate, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # then renamed: a reader never sees half a file
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    partial.replace(path)
    return path


def held_out_accuracy(cfg, model_dir: Path, cache: Path) -> float:
    """``model_dir``'s held-out accuracy on ``cfg``'s task as the arms measure theirs (greedy, the built-in task's
    ``data.num_val`` test problems, `scalerl.trainer.evaluation.evaluate`), kept in ``cache``."""
    if cache.is_file() and json.loads(cache.read_text()).get("model_dir") == str(model_dir):
        return json.loads(cache.read_text())["val/accuracy"]
    import torch

    from scalerl.data.sources import reward_from_config, rows_from_config
    from scalerl.models.load import load_model_and_tokenizer
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.trainer.evaluation import evaluate

    model, tokenizer = load_model_and_tokenizer(cfg.model, str(model_dir), torch.device("cpu"), cfg.trainer.seed)
    model.eval()
    with torch.no_grad():
        metrics = evaluate(BuiltinEngine(model, tokenizer.pad_token_id), tokenizer,
                           rows_from_config(cfg.data, "test", cfg.trainer.seed), reward_from_config(cfg.data),
                           cfg.rollout.max_new_tokens, seed=cfg.trainer.seed)
    cache.write_text(json.dumps({"model_dir": str(model_dir), "val/accuracy": metrics["val/accuracy"]}) + "\n")
    return metrics["val/accuracy"]


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
    """The first evaluated (step, seconds) at which the accuracy is >= ``target``, None if never (to within
    ``ACCURACY_TOLERANCE``)."""
    for step, accuracy, seconds in points:
        if accuracy >= target - ACCURACY_TOLERANCE:
            return step, seconds
    return None


def per_arm(values: list | None) -> dict[str, object]:
    """``--steps`` / ``--lr``'s values per arm: one value is both arms', two are GRPO alone's then the distilled
    arm's (None: the default for both)."""
    values = values or [None]
    return dict(zip(ARMS, values if len(values) == 2 else values * 2))


def targets(runs: dict[str, dict[int, dict]], seeds: list[int], target: float | None,
            gain: float | None) -> dict[int, float]:
    """The held-out accuracy each seed's arms must reach: ``target`` for every seed; or, with ``gain``, that seed's
    SFT start (step 0 of its GRPO run; each seed draws its own held-out problems) plus ``gain``; neither: the lowest
    final accuracy GRPO alone reaches over the seeds."""
    if gain is not None:
        return {seed: runs["grpo"][seed]["curve"][0][1] + gain for seed in seeds}
    if target is None:
        target = min(runs["grpo"][seed]["curve"][-1][1] for seed in seeds)
    return {seed: target for seed in seeds}


def compare(grpo: dict, distill: dict, target: float) -> dict:
    """One seed's two runs against ``target``: each arm's first evaluated (step, training seconds) reaching it
    (None: never within its run) and the ratios GRPO alone / distilled. ``bound``: "=" both reached it (the ratios
    are measured); ">" only the distilled arm did (GRPO alone would reach it after its last step if ever, so the
    ratios of its whole run are lower bounds); "<" only GRPO alone did (upper bounds); None: neither."""
    rg, rd = reached(grpo["curve"], target), reached(distill["curve"], target)
    last_g, last_d = (grpo["curve"][-1][0], grpo["curve"][-1][2]), (distill["curve"][-1][0], distill["curve"][-1][2])
    g, d, bound = {(True, True): (rg, rd, "="), (False, True): (last_g, rd, ">"),
                   (True, False): (rg, last_d, "<"), (False, False): (None, None, None)}[(rg is not None, rd is not None)]
    return {"target": target, "grpo": rg, "distill": rd, "bound": bound,
            "grpo_run": last_g, "distill_run": last_d,
            "steps_ratio": g[0] / d[0] if bound and d[0] else None,
            "time_ratio": g[1] / d[1] if bound and d[1] else None,
            "grpo_final": grpo["curve"][-1][1], "distill_final": distill["curve"][-1][1]}


def format_row(seed: int, row: dict, step_s: tuple[float, float]) -> str:
    """``compare``'s row as a line of the printed table (an arm that never reaches the target: "never in N (T s)",
    its whole run; a bounded ratio: prefixed with > or <)."""
    def cell(hit, run):
        return f"{hit[0]:>5} {hit[1]:>6.0f} s" if hit else f"never in {run[0]} ({run[1]:.0f} s)"

    def ratio(value):
        return "-" if value is None else ("" if row["bound"] == "=" else row["bound"]) + f"{value:.2f}x"

    return (f"{seed:>4} | {row['target']:>6.1%} | {cell(row['grpo'], row['grpo_run']):>20} {row['grpo_final']:>6.1%} | "
            f"{cell(row['distill'], row['distill_run']):>20} {row['distill_final']:>6.1%} | "
            f"{ratio(row['steps_ratio']):>11} {ratio(row['time_ratio']):>10} | {step_s[0]:.2f} / {step_s[1]:.2f}")


def run_tag(args: argparse.Namespace, arm: str) -> str:
    """The part of an arm's run directory naming its settings where they differ from the defaults, so that
    ``--reuse`` under one ``--out`` never takes a run made with other settings for this one."""
    lr, steps = per_arm(args.lr)[arm], per_arm(args.steps)[arm]
    tag = "" if lr is None else f"_lr{lr:g}"
    if steps != DEFAULT_STEPS:
        tag += f"_s{steps}"
    if args.eval_every != DEFAULT_EVAL_EVERY:
        tag += f"_e{args.eval_every}"
    if arm == "grpo+distill":
        if args.top_k:
            tag += f"_top{args.top_k}"
        if args.task_weight != 1.0:
            tag += f"_tw{args.task_weight:g}"
        if args.coef != 1.0:
            tag += f"_coef{args.coef:g}"
    return tag


def settings(args: argparse.Namespace) -> dict:
    """What the teacher and the student's SFT are made with: a later ``--reuse`` under the same ``--out`` must
    have the same (the arms' own settings are in their run directories' names)."""
    return {"difficulty": args.difficulty, "num_train": args.num_train, "num_val": args.num_val,
            "max_new_tokens": args.max_new_tokens, "teacher": list(args.teacher), "student": list(args.student),
            "teacher_steps": args.teacher_steps, "teacher_sft_steps": args.teacher_sft_steps,
            "sft_steps": args.sft_steps, "error_rate": args.error_rate, "teacher_error_rate": args.teacher_error_rate}


def check_settings(args: argparse.Namespace) -> None:
    """Record the settings under ``--out``; with ``--reuse``, refuse an ``--out`` made with other settings."""
    path = args.out / "settings.json"
    if args.reuse and path.is_file():
        before = json.loads(path.read_text())
        differ = {key: (before.get(key), value) for key, value in settings(args).items() if before.get(key) != value}
        if differ:
            sys.exit(f"--reuse: {args.out} was made with other settings ({', '.join(f'{k}: {a} there, {b} now' for k, (a, b) in differ.items())}); "
                     "give another --out, or the same settings")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings(args), indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/distill_demo"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--teacher", type=int, nargs=2, default=[256, 2], metavar=("HIDDEN", "LAYERS"))
    parser.add_argument("--student", type=int, nargs=2, default=[128, 2], metavar=("HIDDEN", "LAYERS"))
    parser.add_argument("--teacher-steps", type=int, default=22,
                        help="the teacher's GRPO steps after its SFT (0: the teacher is its SFT model)")
    parser.add_argument("--sft-steps", type=int, default=1000, help="the student's SFT steps")
    parser.add_argument("--teacher-sft-steps", type=int, default=None, help="the teacher's SFT steps (--sft-steps)")
    parser.add_argument("--error-rate", type=float, default=TEACHER_ERROR_RATE,
                        help="share of the student's SFT demonstrations whose answer is off by one")
    parser.add_argument("--teacher-error-rate", type=float, default=None,
                        help="the same for the teacher's SFT demonstrations (default: --error-rate; 0: all correct)")
    parser.add_argument("--difficulty", type=int, nargs="+", default=None,
                        help="data.difficulty, the arithmetic levels (default: the demo's, 1 2)")
    parser.add_argument("--num-train", type=int, default=None, help="data.num_train (default: the demo's, 9000)")
    parser.add_argument("--num-val", type=int, default=None, help="data.num_val (default: the demo's, 500)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="rollout.max_new_tokens (default: the demo's, 16; levels 3-4 need 20)")
    parser.add_argument("--steps", type=int, nargs="+", default=[DEFAULT_STEPS],
                        help="each student arm's GRPO steps; two values: GRPO alone's, then the distilled arm's")
    parser.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY)
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.distill.coef")
    parser.add_argument("--top-k", type=int, default=0,
                        help="algorithm.distill.top_k: k > 0 trains on the teacher's top-k forward KL (a loss term) "
                             "instead of the sampled tokens' reverse KL (0)")
    parser.add_argument("--task-weight", type=float, default=1.0,
                        help="algorithm.distill.task_weight of the distilled arm (0: distillation alone)")
    parser.add_argument("--lr", type=float, nargs="+", default=None,
                        help="actor.lr of both arms (default: the demo's, 3e-5); two values: GRPO alone's, then "
                             "the distilled arm's")
    target_group = parser.add_mutually_exclusive_group()
    target_group.add_argument("--target", type=float, default=None,
                              help="the held-out accuracy to reach, every seed (default: GRPO alone's lowest final)")
    target_group.add_argument("--target-gain", type=float, default=None,
                              help="the target per seed: that seed's SFT start (step 0) plus this, e.g. 0.05")
    parser.add_argument("--reuse", action="store_true", help="keep the models of stages already under --out")
    parser.add_argument("--only", choices=("teacher", "student"), default=None,
                        help="run only the teacher's training or only the student's SFT, then stop")
    parser.add_argument("--arm", choices=ARMS, default=None,
                        help="train only this arm (with --reuse, a later run without --arm prints the table)")
    args = parser.parse_args()
    if args.teacher_sft_steps is None:
        args.teacher_sft_steps = args.sft_steps
    if args.teacher_error_rate is None:
        args.teacher_error_rate = args.error_rate
    for name in ("steps", "lr"):
        if getattr(args, name) is not None and len(getattr(args, name)) > 2:
            parser.error(f"--{name} takes one value (both arms) or two (GRPO alone's, then the distilled arm's), "
                         f"got {len(getattr(args, name))}")
    for name in ("error_rate", "teacher_error_rate"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")

    from scalerl.trainer.rl_trainer import train
    from scalerl.trainer.sft_trainer import train_sft

    out = args.out
    check_settings(args)
    task = task_overrides(args)
    base = load_config(DEMO_CONFIG, task)

    def demonstrations(error_rate: float) -> Path:
        """The demonstrations file of ``error_rate`` (the demo's rate: data/demonstrations.jsonl)."""
        name = "demonstrations" + ("" if error_rate == TEACHER_ERROR_RATE else f"_err{error_rate:g}")
        path = out / "data" / f"{name}.jsonl"
        if not (args.reuse and path.is_file()):
            write_demonstrations(base, path, error_rate, base.trainer.seed)
        return path

    def sft(name: str, size: list[int], steps: int, error_rate: float) -> str:
        if args.reuse and (out / name / "sft" / "model" / "config.json").is_file():
            return str(out / name / "sft" / "model")
        cfg = load_config(DEMO_CONFIG, [*task, f"sft.steps={steps}", *model_overrides(*size)])
        cfg.data.train_files, cfg.sft.output_dir = [str(demonstrations(error_rate))], str(out / name / "sft")
        return train_sft(cfg)["model_dir"]

    def student_sft() -> str:
        print(f"[student] {args.student[0]} wide x {args.student[1]} layers: SFT {args.sft_steps} steps on "
              f"demonstrations {args.error_rate:.0%} off by one", flush=True)
        return sft("student", args.student, args.sft_steps, args.error_rate)

    if args.only == "student":
        student_sft()
        return

    def teacher_stage() -> tuple[Path, float, float]:
        """The teacher's model directory (trained unless ``--reuse`` finds it), its held-out accuracy after SFT
        and at the end."""
        grpo_dir = out / "teacher" / "grpo"
        model_dir = grpo_dir / "final" if args.teacher_steps else out / "teacher" / "sft" / "model"
        if not (args.reuse and (model_dir / "config.json").is_file()):
            print(f"[teacher] {args.teacher[0]} wide x {args.teacher[1]} layers: SFT {args.teacher_sft_steps} steps "
                  f"on demonstrations {args.teacher_error_rate:.0%} off by one, then GRPO {args.teacher_steps} steps",
                  flush=True)
            model_dir = Path(sft("teacher", args.teacher, args.teacher_sft_steps, args.teacher_error_rate))
            if args.teacher_steps:
                cfg = load_config(DEMO_CONFIG, [*task, *model_overrides(*args.teacher),
                                                f"trainer.total_steps={args.teacher_steps}"])
                cfg.trainer.init_from, cfg.trainer.output_dir = str(model_dir), str(grpo_dir)
                model_dir = Path(train(cfg)["final_model"])
        if args.teacher_steps:  # its GRPO run evaluated it before its first step and after its last
            points = curve(grpo_dir / "metrics.jsonl")[0]
            return model_dir, points[0][1], points[-1][1]
        accuracy = held_out_accuracy(load_config(DEMO_CONFIG, [*task, *model_overrides(*args.teacher)]), model_dir,
                                     out / "teacher" / "held_out.json")
        return model_dir, accuracy, accuracy

    # GRPO alone needs no teacher: `--arm grpo` runs can go while the teacher trains (`--only teacher`).
    if args.arm != "grpo":
        teacher_dir, teacher_sft_accuracy, teacher_accuracy = teacher_stage()
        print(f"[teacher] held-out accuracy {teacher_accuracy:.1%}", flush=True)
    if args.only == "teacher":
        return

    student_dir = student_sft()
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            run_dir = out / "student" / f"{arm}{run_tag(args, arm)}_seed{seed}"
            steps, lr = per_arm(args.steps)[arm], per_arm(args.lr)[arm]
            if args.reuse and _finished(run_dir / "metrics.jsonl", steps):
                points, step_s = curve(run_dir / "metrics.jsonl")
                runs[arm][seed] = {"curve": points, "median_step_s": step_s}
                continue
            if args.arm not in (None, arm):
                continue
            print(f"[seed {seed}] {arm}: {steps} GRPO steps", flush=True)
            overrides = [*task, *model_overrides(*args.student), f"trainer.seed={seed}",
                         f"trainer.total_steps={steps}", f"trainer.eval_every={args.eval_every}",
                         "trainer.save_every=0"]
            if lr is not None:
                overrides.append(f"actor.lr={lr}")
            if arm == "grpo+distill":
                overrides += [f"algorithm.distill.teacher={teacher_dir}",
                              f"algorithm.distill.task_weight={args.task_weight}",
                              f"algorithm.distill.coef={args.coef}", f"algorithm.distill.top_k={args.top_k}"]
            cfg = load_config(DEMO_CONFIG, overrides)
            cfg.trainer.init_from, cfg.trainer.output_dir = student_dir, str(run_dir)
            train(cfg)
            points, step_s = curve(Path(cfg.trainer.output_dir) / "metrics.jsonl")
            runs[arm][seed] = {"curve": points, "median_step_s": step_s}

    if args.arm is not None:
        return
    target = targets(runs, args.seeds, args.target, args.target_gain)
    print()
    print(f"teacher ({args.teacher[0]}x{args.teacher[1]}): held-out accuracy {teacher_sft_accuracy:.1%} after SFT"
          + (f", {teacher_accuracy:.1%} after GRPO" if args.teacher_steps else ""))
    # Each seed draws its own held-out problems (trainer.seed), so the SFT start differs by seed.
    starts = {seed: runs["grpo"][seed]["curve"][0][1] for seed in args.seeds}
    rule = (f"its SFT start + {args.target_gain:.1%}" if args.target_gain is not None
            else f"{target[args.seeds[0]]:.1%}")
    steps, lrs = per_arm(args.steps), per_arm(args.lr)
    arms = ", ".join(f"{arm} {steps[arm]} steps at lr {lrs[arm] if lrs[arm] is not None else 'the demo default'}"
                     for arm in ARMS)
    print(f"student ({args.student[0]}x{args.student[1]}) after SFT: "
          + " / ".join(f"{starts[seed]:.1%}" for seed in args.seeds) + f" (seeds {' / '.join(map(str, args.seeds))}); "
          f"target held-out accuracy per seed: {rule}; {arms}")
    at_start = [seed for seed in args.seeds if starts[seed] >= target[seed] - ACCURACY_TOLERANCE]
    if at_start:
        print(f"  the SFT start already reaches the target in seed(s) {', '.join(map(str, at_start))}: step 0 there "
              "measures no training (give a higher --target)")
    print(f"{'seed':>4} | {'target':>6} | {'GRPO: step, s':>20} {'final':>6} | {'+distill: step, s':>20} {'final':>6} | "
          f"{'steps ratio':>11} {'time ratio':>10} | step s (median)")
    table = []
    for seed in args.seeds:
        g, d = runs["grpo"][seed], runs["grpo+distill"][seed]
        row = compare(g, d, target[seed])
        print(format_row(seed, row, (g["median_step_s"], d["median_step_s"])))
        table.append({"seed": seed, **row})
    result = {"target": target, "target_gain": args.target_gain, "settings": settings(args),
              "teacher": {"size": args.teacher, "sft_accuracy": teacher_sft_accuracy, "accuracy": teacher_accuracy},
              "student": {"size": args.student}, "steps": steps, "coef": args.coef,
              "top_k": args.top_k, "task_weight": args.task_weight, "lr": lrs, "table": table,
              "runs": runs}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"curves: {out / 'result.json'}")


if __name__ == "__main__":
    main()
