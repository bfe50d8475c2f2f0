"""bf16 against fp32 in scalerl's own RL trainer: seconds per step and per phase, and their bf16 / fp32 ratios,
measured in the same run on the demo's built-in model, a small model and a Qwen2.5-0.5B-shaped one.

    python benchmarks/precision.py [--models builtin,small,0.5b] [--steps 3] [--repeats 2] [--layers-0.5b 24]

Each (model, precision) cell is a fresh process running the demo's arithmetic task (GRPO, random weights,
nothing downloaded) for one untimed step and ``--steps`` timed ones; precisions alternate within each
repeat (fp32 first in odd repeats, bf16 first in even ones), so a machine that gets busier or quieter does
not favour one. The table is the median over repeats of each cell's median step; ratio = fp32 / bf16
seconds (above 1: bf16 faster); ``cpu_step`` is the process's CPU seconds per step (others' load on the
cores left out; ``--clock cpu`` makes the phases CPU seconds too). Phases are the trainer's ``timing_s/*``:
gen (the built-in engine, decoding in the run's precision: bf16 from bf16 weight copies under
trainer.precision=bf16), old_log_prob (skipped where the
engine's log-probs stand in for the training forward's: fp32, and bf16 on CPU; ``--extra`` can force the
recompute, e.g. ``rollout.max_num_seqs=8``), update_actor. ``--auto`` adds a trainer.precision=auto cell per
model and prints what it chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("gen", "old_log_prob", "update_actor")
# name -> (model fields for a random model directory, or None for the demo's built-in model; config overrides)
MODELS: dict[str, tuple[dict | None, list[str]]] = {
    "builtin": (None, []),  # the demo: h128, 2 layers, 64 prompts x 8 samples, 16 new tokens
    "small": (dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4),
              ["trainer.batch_size=16", "actor.ppo_mini_batch_size=128", "actor.ppo_micro_batch_size=64"]),
    "0.5b": (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2),
             ["trainer.batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=4"]),
}

STEP_SCRIPT = r"""
import json, statistics, sys, tempfile, time
from scalerl.core.config import load_config
from scalerl.trainer.rl_trainer import RLTrainer
steps, overrides, clock = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
if clock == "cpu":  # the trainer's phase timers read this process's CPU seconds instead of wall seconds
    import types
    import scalerl.perf.timing
    scalerl.perf.timing.time = types.SimpleNamespace(perf_counter=time.process_time)
cfg = load_config("scalerl/configs/demo.yaml", ["trainer.logger=[]", "data.num_val=0", "trainer.eval_every=0",
                  "trainer.monitor_every=0", f"trainer.output_dir={tempfile.mkdtemp()}", *overrides])
trainer = RLTrainer.from_config(cfg)
rows = []
for i in range(steps + 1):
    start, cpu = time.perf_counter(), time.process_time()
    m = trainer.advance()
    if i:  # the first step pays one-time costs (allocations, kernel choice)
        rows.append({"step": time.perf_counter() - start, "cpu_step": time.process_time() - cpu,
                     **{k[9:]: v for k, v in m.items() if k.startswith("timing_s/")},
                     "tokens_per_s": m["perf/throughput"], "mfu": m.get("perf/mfu", 0.0)})
keys = set.intersection(*(set(r) for r in rows))
print("RESULT " + json.dumps({"precision": trainer.cfg.trainer.precision,
                              **{k: statistics.median(r[k] for r in rows) for k in keys}}))
"""


def write_model(fields: dict, directory: Path) -> Path:
    """A random-weight model directory with the built-in character tokenizer (its 99 ids fit any vocab here)."""
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.models.hf_checkpoint import save_pretrained

    model = build_model(ModelConfig(model_type="qwen2", max_position_embeddings=4096, **fields), seed=0)
    return save_pretrained(model, directory)


def model_overrides(name: str, workdir: Path, layers_05b: int) -> list[str]:
    fields, overrides = MODELS[name]
    if fields is None:
        return list(overrides)
    fields = dict(fields, num_hidden_layers=layers_05b) if name == "0.5b" else fields
    directory = workdir / name
    if not directory.exists():
        write_model(fields, directory)
    return [f"model.path={directory}", "model.tokenizer=builtin", *overrides]


def run_cell(overrides: list[str], precision: str, steps: int, timeout_s: float, clock: str = "wall") -> dict:
    done = subprocess.run([sys.executable, "-c", STEP_SCRIPT, str(steps),
                           json.dumps([*overrides, f"trainer.precision={precision}"]), clock],
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            chose = next((ln for ln in done.stdout.splitlines() if ln.startswith("trainer.precision=auto")), "")
            return {**result, "said": chose}
    raise RuntimeError(f"{precision} cell failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="builtin,small,0.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers-0.5b", dest="layers_05b", type=int, default=24,
                        help="decoder layers of the 0.5B-shaped model (24 in the real one)")
    parser.add_argument("--auto", action="store_true", help="also run trainer.precision=auto and say what it chose")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what the phases (timing_s/*) count: wall seconds, or the process's CPU seconds "
                             "(on a shared machine, others' time on the cores left out)")
    parser.add_argument("--extra", default="", help="comma-separated config overrides for every cell")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models.split(","):
            overrides = model_overrides(name, Path(workdir), args.layers_05b) + [e for e in args.extra.split(",") if e]
            cells: dict[str, list[dict]] = {"fp32": [], "bf16": []}
            for repeat in range(args.repeats):
                order = ("fp32", "bf16") if repeat % 2 == 0 else ("bf16", "fp32")
                for precision in order:
                    cells[precision].append(run_cell(overrides, precision, args.steps, args.timeout, args.clock))
                    print(f"{name} {precision} repeat {repeat}: {cells[precision][-1]['step']:.3f} s/step", flush=True)
            if args.auto:
                auto = run_cell(overrides, "auto", 1, args.timeout, args.clock)
                cells["auto"] = [auto]
                print(f"{name} auto: {auto['said']}", flush=True)
            results[name] = {p: {k: statistics.median(c[k] for c in runs) for k in runs[0] if k not in ("precision", "said")}
                             for p, runs in cells.items()}
            if args.auto:
                results[name]["auto"]["chose"] = cells["auto"][0]["precision"]
    print("\nmodel     phase          fp32 s    bf16 s   fp32/bf16")
    for name, cells in results.items():
        for phase in ("step", "cpu_step", *PHASES):
            fp32, bf16 = cells["fp32"].get(phase, 0.0), cells["bf16"].get(phase, 0.0)
            ratio = f"{fp32 / bf16:9.2f}x" if min(fp32, bf16) > 1e-3 else "        -"  # fp32 reuses the log-probs
            print(f"{name:9s} {phase:13s} {fp32:8.3f}  {bf16:8.3f}  {ratio}")
        tps = cells["bf16"]["tokens_per_s"] / cells["fp32"]["tokens_per_s"]
        print(f"{name:9s} {'tokens/s':13s} {cells['fp32']['tokens_per_s']:8.0f}  {cells['bf16']['tokens_per_s']:8.0f}  "
              f"{tps:9.2f}x")
        if "auto" in cells:
            print(f"{name:9s} auto chose {cells['auto']['chose']}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
