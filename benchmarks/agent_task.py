"""Does the tool matter? Held-out accuracy on the built-in tool task (``a @ b = a*b + a + b``, two-digit
operands) of the built-in model trained and evaluated with the calculator tool (`scalerl demo --agent`: SFT on
the scripted teacher's tool-use demonstrations, then GRPO in episodes with the tool) against the same model
trained and evaluated without it (SFT on direct answers, then single-turn GRPO), per seed, both arms in the
same run, after SFT and after GRPO.

    python benchmarks/agent_task.py                       # seeds 0 1 2, the demo's defaults (demo_agent.yaml)
    python benchmarks/agent_task.py --seeds 0 --arms tool sft.steps=150 trainer.total_steps=10

Overrides (key=value) apply to both arms. Each run's demo_result.json lands under --out/<arm>_s<seed>/; the
table is printed at the end and written to --out/agent_task.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = {"tool": True, "no-tool": False}


def _table(results: list[dict]) -> str:
    lines = ["| seed | arm | after SFT | after GRPO | GRPO gain | tool called (after GRPO) | wall time |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['seed']} | {'with the tool' if r['use_tool'] else 'without the tool'} | "
                     f"{r['heldout_accuracy_sft']:.1%} | {r['heldout_accuracy_grpo']:.1%} | {r['gain_points']:+.1f} | "
                     f"{r['tool_call_rate_grpo']:.0%} | {r['total_seconds']:.0f} s |")
    for arm in ("tool", "no-tool"):
        chosen = [r for r in results if r["use_tool"] == ARMS[arm]]
        if chosen:
            sft = sum(r["heldout_accuracy_sft"] for r in chosen) / len(chosen)
            grpo = sum(r["heldout_accuracy_grpo"] for r in chosen) / len(chosen)
            lines.append(f"| mean of {len(chosen)} | {'with the tool' if ARMS[arm] else 'without the tool'} | "
                         f"{sft:.1%} | {grpo:.1%} | {100 * (grpo - sft):+.1f} | | |")
    by_seed = {}
    for r in results:
        by_seed.setdefault(r["seed"], {})[r["use_tool"]] = r["heldout_accuracy_grpo"]
    gaps = [100 * (v[True] - v[False]) for v in by_seed.values() if True in v and False in v]
    if gaps:
        lines.append("")
        lines.append("tool minus no tool, after GRPO (points): " + ", ".join(f"{g:+.1f}" for g in gaps)
                     + f"; mean {sum(gaps) / len(gaps):+.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from scalerl.core.config import load_config
    from scalerl.demo import AGENT_DEMO_CONFIG, run_agent_demo

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["tool", "no-tool"])
    parser.add_argument("--out", default="outputs/agent_task")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for both arms")
    args = parser.parse_args(argv)
    results = []
    for seed in args.seeds:
        for arm in args.arms:
            cfg = load_config(AGENT_DEMO_CONFIG, [*args.overrides, f"trainer.seed={seed}",
                                                  f"trainer.output_dir={Path(args.out) / f'{arm}_s{seed}'}"])
            results.append(run_agent_demo(cfg, use_tool=ARMS[arm]))
            print(_table(results), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "agent_task.json").write_text(json.dumps(results, indent=2))
    print("\n" + _table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
