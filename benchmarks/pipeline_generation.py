"""Generation under pipeline parallelism: the pipeline ranks split the rows vs one replica generating them all.

    python benchmarks/pipeline_generation.py [--prompts 4,32] [--repeats 8]

Two ranks (gloo on loopback, one thread each) build the trainer at `parallel.pp=2` on the bench's model
(the built-in model at 4 layers, 4 samples of 16 new tokens per prompt), run two steps, then time,
alternating, the trainer's generation of a step's rows (each pipeline rank generates half on its replica and
they exchange the outputs) and the same rows generated whole by a copy of the replica in the same process
(what every pipeline rank did before the split). Medians over ``--repeats``; the ratio is whole / split.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.spawned_group import run_in_group  # noqa: E402


def _rank(rank: int, prompts: int, repeats: int, out: str) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    from scalerl.bench.matrix import BENCH_BASE, BUILTIN_MODEL
    from scalerl.core.config import load_config
    from scalerl.parallel.distributed import init_distributed
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.trainer.rl_trainer import RLTrainer

    rows = prompts * 4
    cfg = load_config(None, [*BENCH_BASE, *BUILTIN_MODEL, f"trainer.batch_size={prompts}",
                             f"actor.ppo_mini_batch_size={rows}", "trainer.total_steps=100", "parallel.pp=2",
                             f"trainer.output_dir={out}/pp_prompts{prompts}"])
    # every collective below, the barriers included, inherits the group's 300 s limit
    ctx = init_distributed(cfg.parallel, torch.device("cpu"), 0, dist_timeout_s=300, rendezvous_timeout_s=300)
    trainer = RLTrainer(cfg, ctx)
    for _ in range(2):
        trainer.advance()
    batch = trainer.rollout_phase.feed.draw(trainer.step)
    whole = BuiltinEngine(copy.deepcopy(trainer.policy.model).eval(), trainer.tokenizer.pad_token_id)
    trainer.policy.eval()
    split_s, whole_s = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        trainer.rollouts.generate(batch)
        split_s.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        whole.generate(batch.prompts, batch.sampling)
        whole_s.append(time.perf_counter() - start)
    return {"rows": rows, "split_ms": 1e3 * statistics.median(split_s), "whole_ms": 1e3 * statistics.median(whole_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="4,32", help="prompts per step (x 4 samples = rows), comma-separated")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    out = ROOT / "outputs" / "bench_pipeline_generation"
    for prompts in (int(p) for p in args.prompts.split(",")):
        results = run_in_group(_rank, 2, prompts, args.repeats, str(out), timeout_s=1200)
        for r in results:
            print(f"{r['rows']:4d} rows: split over 2 pipeline ranks {r['split_ms']:7.1f} ms | one replica, all rows "
                  f"{r['whole_ms']:7.1f} ms | whole / split {r['whole_ms'] / r['split_ms']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
