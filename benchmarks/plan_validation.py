"""`scalerl plan` against measured runs on this machine: per cell and per repeat, the plan's predicted step time,
time per phase and peak memory per phase beside what a run measured right after the plan calibrated.

    .venv/bin/python benchmarks/plan_validation.py [--repeats 2] [--cells tiny,tiny-dp2,...] [--output FILE]
    .venv/bin/python benchmarks/plan_validation.py --from FILE     # re-predict stored measurements, no runs

Each repeat of a cell: the load average (`os.getloadavg`, what `uptime` prints), then `scalerl plan CELL --json`
(which calibrates now: the compute probe on the cell's architecture, an AdamW step, gloo loopback, the runtime
RSS), then the run, then the load again. The machine is shared, so the plan is calibrated right before each run
it is compared with, and every repeat has its own calibration and its own error.

- Every cell runs `scalerl train` for 6 steps first (under torchrun when multi-rank): the step's and each
  phase's time are the trainer's `timing_s/*` (rank 0; median of steps 4-6: tensor parallelism is still
  warming up in steps 1-3), the run as a user runs it.
- Colocated cells then run `scalerl doctor --performance-profiling CELL --steps 3 --warmup 3` for each phase's
  peak resident set (VmHWM reset per phase, the largest rank), compared by
  `scalerl.doctor.plan_comparison.compare_plan`, which also gives the checkpoint save's time. (The profiler's
  own step times are not used: its bookkeeping at every phase took a third of a 32-wide two-rank step.)
- Standalone-worker cells (the profiler runs colocated rollouts only) take memory from the same train run's
  `perf/max_memory_gb` (peak RSS of the whole run, no per-phase split, as the trainer logs it), against the
  larger of the plan's trainer peak over the step's phases and its rollout worker's peak.

The predictions are recomputed from each repeat's stored calibration with the model code of this checkout
(`--from` does only that), so a change to the model is judged against the same measurements and the same
calibrations. Errors are planned / measured - 1; targets: step time within 20%, peak memory within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ["data.num_train=200", "data.num_val=8", "rollout.n=4", "rollout.max_new_tokens=8", "trainer.batch_size=4",
        "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=4", "trainer.eval_every=0",
        "trainer.logger=[jsonl]", "trainer.cpu_threads=1", "trainer.overwrite=true"]
# tests/tiny.py's built-in model: hidden 32, 4 heads over 2 kv heads, 2 layers
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4",
        "model.num_key_value_heads=2"]
# Qwen2.5-0.5B's layer shape (hidden 896, MLP 4864, 14 heads over 2 kv heads) at 2 layers over the built-in
# vocabulary, random weights (about 30M parameters)
HALF_B = ["model.hidden_size=896", "model.intermediate_size=4864", "model.num_attention_heads=14",
          "model.num_key_value_heads=2", "model.num_hidden_layers=2"]
STANDALONE = ["rollout.placement=standalone", "rollout.workers=1"]
# name: (processes, overrides, how it is measured)
CELLS = {
    "tiny": (1, TINY, "doctor"),
    "0.5b-shaped": (1, HALF_B, "doctor"),
    "tiny-dp2": (2, TINY, "doctor"),
    "0.5b-shaped-fsdp2": (2, [*HALF_B, "parallel.dp_shard=2"], "doctor"),
    "0.5b-shaped-tp2": (2, [*HALF_B, "parallel.tp=2"], "doctor"),
    "0.5b-shaped-pp2": (2, [*HALF_B, "parallel.pp=2"], "doctor"),
    "0.5b-shaped-ac": (1, [*HALF_B, "model.activation_checkpointing=true"], "doctor"),
    "tiny-standalone": (2, [*TINY, *STANDALONE], "train"),
    "tiny-async1": (2, [*TINY, *STANDALONE, "rollout.staleness=1"], "train"),
}
TIME_TARGET, MEMORY_TARGET = 0.20, 0.10
# The plan predicts a step once the run is warm; a tensor-parallel rank's generation took 3.5, 1.8, 0.9 and
# 0.67 s in steps 1-4 here (DTensor caches its sharding rules per new shape), so four steps warm up first.
# A 32-wide step (20-70 ms) varies by 3x from one step to the next on this shared machine (an asynchronous
# cell's steps over 30 steps: 22-72 ms), so those cells take the median of 16 steps; a 0.5B-shaped one of 5.
DOCTOR_STEPS, DOCTOR_WARMUP = 3, 3
TRAIN_WARMUP, TRAIN_STEPS, TRAIN_STEPS_32_WIDE = 4, 9, 20
STEP_PHASES_MEASURED = {"generation": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob",
                        "ref_log_prob": "timing_s/ref", "update": "timing_s/update_actor",
                        "weight_sync": "timing_s/update_weights"}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _launch(ranks: int, args: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "scalerl", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "scalerl", *args]


def _run(cmd: list[str], ok=(0,)) -> None:
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900, check=False)
    if done.returncode not in ok:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")


def measure_once(name: str, work: Path) -> dict:
    """One repeat: load, plan (calibrating now), run, load."""
    ranks, overrides, how = CELLS[name]
    args = [*BASE, *overrides, f"trainer.output_dir={work / 'run'}"]
    load_before = os.getloadavg()
    plan_path = work / "plan.json"
    start = time.perf_counter()
    _run(_launch(1, ["plan", *args, "--devices-per-node", str(ranks), "--no-recommend", "--json", str(plan_path)]),
         ok=(0, 1))
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    # the run as a user runs it: its step and phase times (the profiler's own bookkeeping, a /proc read and
    # a peak reset at every phase, took a third of a 32-wide two-rank step: 0.15 s profiled, 0.10 s not)
    total = TRAIN_STEPS_32_WIDE if "model.hidden_size=32" in overrides else TRAIN_STEPS
    _run(_launch(ranks, ["train", *args, f"trainer.total_steps={total}"]))
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    later = steps[TRAIN_WARMUP:] or steps[-1:]
    measured = {"step_s": statistics.median(r["timing_s/step"] for r in later),
                "phases_s": {p: statistics.median(r.get(k, 0.0) for r in later)
                             for p, k in STEP_PHASES_MEASURED.items()},
                "peak_gb": max(r.get("perf/max_memory_gb", 0.0) for r in steps)}
    if how == "doctor":  # and each phase's peak memory, which only the profiler splits by phase
        report = work / "doctor.json"
        _run(_launch(ranks, ["doctor", "--performance-profiling", *args, "--steps",
                             str(DOCTOR_STEPS), "--warmup", str(DOCTOR_WARMUP), "--scratch-dir", str(work / "scratch"),
                             "--json", str(report)]), ok=(0, 1))
        measured["records"] = json.loads(report.read_text())["measurements"]["profile"]["per_rank"]
    run_s = time.perf_counter() - start
    return {"load_before": load_before, "load_after": os.getloadavg(), "plan_s": plan_s, "run_s": run_s,
            "plan": json.loads(plan_path.read_text()), "measured": measured}


_RUNTIME: dict[str, float] = {}


def predict(name: str, calibration: dict) -> dict:
    """The plan of ``name`` at a stored calibration, with this checkout's model. A calibration stored before
    the runtime probe read VmHWM (its ru_maxrss included the plan process's own probe model, inherited at the
    fork) gets the runtime RSS measured again here: it is memory, the same under any load."""
    from scalerl.core.config import load_config
    from scalerl.plan.cli import Cluster, make_plan
    from scalerl.plan.timing import Calibration, measure_runtime

    ranks, overrides, _ = CELLS[name]
    args = [*BASE, *overrides, "trainer.output_dir=/nonexistent/plan-validation"]
    cal = Calibration.from_dict(calibration)
    if not any("VmHWM" in note or "ran two steps" in note for note in cal.notes):  # both read the child's own peak
        if name not in _RUNTIME:
            _RUNTIME[name] = measure_runtime(None, args).runtime_bytes
            print(f"  ({name}: runtime RSS re-measured with the VmHWM probe: {_RUNTIME[name] / 2**30:.3f} GiB, "
                  f"stored {cal.runtime_bytes / 2**30:.3f})")
        cal.runtime_bytes = _RUNTIME[name]
    plan = make_plan(load_config(None, args), Cluster(1, ranks, "cpu"), overrides=args, recommend=False,
                     calibration=cal)
    return plan.to_dict()


def _err(planned: float | None, measured: float | None) -> float | None:
    if planned is None or not measured:
        return None
    return planned / measured - 1


def compare(name: str, repeat: dict) -> dict:
    """Rows (phase, planned s, measured s, error, planned GiB, measured GiB, error) of one repeat."""
    from scalerl.doctor.plan_comparison import compare_plan
    from scalerl.plan.timing import STEP_PHASES

    plan = predict(name, repeat["plan"]["calibration"])
    measured = repeat["measured"]
    if "records" in measured:
        rows = compare_plan(plan, measured["records"])["rows"]
        if "step_s" in measured:  # times from the unprofiled run (stored since 2026-12-05 07:45 UTC)
            for r in rows:
                seconds = measured["step_s"] if r["phase"] == "step" else measured["phases_s"].get(r["phase"])
                if seconds is not None:
                    r["measured_s"] = seconds
                    r["time_error"] = _err(r["planned_s"], seconds) if seconds >= 1e-3 else None
    else:
        step_peak = max((v["total"] for k, v in plan["memory_gb"].items() if k in STEP_PHASES), default=None)
        if plan.get("worker_memory_gb"):
            step_peak = max(step_peak or 0.0, plan["worker_memory_gb"]["total"])
        rows = [{"phase": p, "planned_s": plan["seconds"].get(p, 0.0), "measured_s": measured["phases_s"][p],
                 "time_error": _err(plan["seconds"].get(p, 0.0), measured["phases_s"][p])
                 if measured["phases_s"][p] >= 1e-3 else None,
                 "planned_gb": None, "measured_gb": None, "memory_error": None} for p in STEP_PHASES_MEASURED]
        rows.append({"phase": "step", "planned_s": plan["step_seconds"], "measured_s": measured["step_s"],
                     "time_error": _err(plan["step_seconds"], measured["step_s"]), "planned_gb": step_peak,
                     "measured_gb": measured["peak_gb"], "memory_error": _err(step_peak, measured["peak_gb"])})
    return {"rows": rows, "calibration": plan["calibration"]["source"]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def report(results: dict) -> list[dict]:
    """Prints each cell's repeats, phase by phase, and a summary line per cell; returns the summary."""
    summary = []
    for name, cell in results.items():
        ranks, overrides, how = CELLS[name]
        print(f"\n== {name}: {ranks} process(es), times by scalerl train, memory by {'scalerl doctor --performance-profiling' if how == 'doctor' else 'scalerl train'}; "
              f"{' '.join(overrides)}")
        step_errors, memory_errors = [], []
        for i, repeat in enumerate(cell["repeats"]):
            compared = compare(name, repeat)
            lb, la = repeat["load_before"], repeat["load_after"]
            print(f"  repeat {i + 1}: load {lb[0]:.2f} before, {la[0]:.2f} after (1-min avg; 5-min {la[1]:.2f}); "
                  f"plan {repeat['plan_s']:.0f} s, run {repeat['run_s']:.0f} s")
            print(f"    {'phase':16s} {'planned s':>10s} {'measured s':>10s} {'error':>6s} {'planned GiB':>11s} "
                  f"{'measured GiB':>12s} {'error':>6s}")
            for r in compared["rows"]:
                if r["measured_s"] is None and r["measured_gb"] is None:
                    continue
                print(f"    {r['phase']:16s} {_f(r['planned_s'], '10.4f')} {_f(r['measured_s'], '10.4f')} "
                      f"{_pct(r['time_error']):>6s} {_f(r['planned_gb'], '11.3f')} {_f(r['measured_gb'], '12.3f')} "
                      f"{_pct(r['memory_error']):>6s}")
                if r["phase"] == "step":
                    step_errors.append(r["time_error"])
                    memory_errors.append(r["memory_error"])
        summary.append({"cell": name, **cell_verdict(step_errors, memory_errors)})
    print("\nsummary (error = planned / measured - 1 per repeat, then the median of the cell's repeats; targets: step "
          "within 20%, peak memory within 10%; met: in every repeat / by the median)")
    for s in summary:
        print(f"  {s['cell']:18s} step {' / '.join(_pct(e) for e in s['step_errors']):22s} "
              f"median {_pct(s['step_median']):>5s} {_met(s['step_met'])}/{_met(s['step_median_met'])}  "
              f"peak memory {' / '.join(_pct(e) for e in s['memory_errors']):16s} "
              f"median {_pct(s['memory_median']):>4s} {_met(s['memory_met'])}/{_met(s['memory_median_met'])}")
    return summary


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def cell_verdict(step_errors: list, memory_errors: list) -> dict:
    """A cell's errors against the targets: met in every repeat, and met by the median of its repeats (this
    machine's run-to-run variation is of the step-time target's size, so one repeat does not say where the
    plan stands). A repeat without a measurement (None) misses."""
    def median(errors):
        return statistics.median(errors) if errors and None not in errors else None

    def within(error, target):
        return error is not None and abs(error) <= target

    step_median, memory_median = median(step_errors), median(memory_errors)
    return {"step_errors": step_errors, "memory_errors": memory_errors,
            "step_median": step_median, "memory_median": memory_median,
            "step_met": bool(step_errors) and all(within(e, TIME_TARGET) for e in step_errors),
            "memory_met": bool(memory_errors) and all(within(e, MEMORY_TARGET) for e in memory_errors),
            "step_median_met": within(step_median, TIME_TARGET),
            "memory_median_met": within(memory_median, MEMORY_TARGET)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of {', '.join(CELLS)}")
    parser.add_argument("--output", default="plan_validation.json")
    parser.add_argument("--from", dest="from_file", help="re-predict the measurements stored in this file")
    args = parser.parse_args()
    if args.from_file:
        report(json.loads(Path(args.from_file).read_text()))
        return 0
    names = args.cells.split(",")
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        parser.error(f"--cells: unknown {', '.join(unknown)}; known: {', '.join(CELLS)}")
    out = Path(args.output)
    results = {name: {"repeats": []} for name in names}
    with tempfile.TemporaryDirectory(prefix="scalerl-plan-validation-") as tmp:
        # every cell once, then every cell again: a load that comes and goes over minutes falls on each cell's
        # repeats differently, rather than on all repeats of one cell
        for i in range(args.repeats):
            for name in names:
                work = Path(tmp) / f"{name}-{i}"
                work.mkdir()
                results[name]["repeats"].append(measure_once(name, work))
                out.write_text(json.dumps(results, indent=1))  # kept as it grows: a long run can be re-read
                print(f"{name} repeat {i + 1} done", flush=True)
    report(results)
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
