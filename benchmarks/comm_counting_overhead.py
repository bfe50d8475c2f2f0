"""What counting communication costs: one forward + backward with and without scalerl's counting, per
layout, and under torch's `CommDebugMode` (the alternative for tensor parallelism), in one run.

    python benchmarks/comm_counting_overhead.py [--iters 20] [--hidden 256] [--layers 4] [--tokens 64]

Two gloo ranks on loopback. For each layout (DDP, FSDP, TP) the same model is laid out twice, once with the
process's `CommCounter` and once without (DDP then runs its built-in C++ all-reduce, FSDP its default
comms, TP no hooks); the variants are timed alternately (median of ``--iters`` each, the slower rank's
time), so machine noise hits them alike. DDP is also timed with torch's own Python ``allreduce_hook`` (what
any Python comm hook costs, counting aside); TP under `CommDebugMode`, entered per forward + backward (in
torch 2.13 one context spanning a backward and a second forward fails in its module tracker).
Printed ratios are counted / uncounted; 1.00 means free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def _rank(rank: int, port: int, args: argparse.Namespace, results) -> None:
    sys.path.insert(0, str(REPO))
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    from torch.distributed.tensor.debug import CommDebugMode

    from scalerl.comm.counting.accounting import CommCounter
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.parallel.distributed import DistContext
    from scalerl.parallel.mesh import ParallelDims
    from scalerl.parallel.parallelize import MicroBatch, parallelize

    cfg = ModelConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      tie_word_embeddings=False)
    ids = torch.randint(0, 256, (4, args.tokens), generator=torch.Generator().manual_seed(0))
    micro = [MicroBatch(ids, torch.ones_like(ids), torch.zeros(4))]

    def loss_fn(out, target):
        return out.float().pow(2).mean()

    out = {}
    for name, shape in {"ddp": (1, 2, 1, 1), "fsdp": (1, 1, 2, 1), "tp": (1, 1, 1, 2)}.items():
        dims = ParallelDims(*shape)
        mesh, dp_mesh = dims.build_mesh("cpu")
        ctx = DistContext(dims, mesh, dp_mesh, rank=rank, comm=CommCounter())
        variants = {"uncounted": _uncounted(build_model(cfg, seed=0), ctx, name),
                    "counted": parallelize(build_model(cfg, seed=0), ctx)}
        for parts in variants.values():
            parts.train()
        if name == "tp":
            variants["CommDebugMode"] = variants["uncounted"]
        if name == "ddp":  # torch's own Python all-reduce hook, uncounted: what a Python hook costs by itself
            variants["torch allreduce_hook"] = _uncounted(build_model(cfg, seed=0), ctx, name, python_hook=True)
            variants["torch allreduce_hook"].train()
        times = {v: [] for v in variants}
        for _ in range(args.iters + 2):  # the first two are warm-up
            for v, parts in variants.items():
                dist.barrier()
                start = time.perf_counter()
                if v == "CommDebugMode":
                    with CommDebugMode():
                        parts.forward_backward(micro, loss_fn)
                else:
                    parts.forward_backward(micro, loss_fn)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[v].append(float(elapsed))
        out[name] = {v: statistics.median(t[2:]) for v, t in times.items()}
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def _uncounted(model, ctx, layout: str, python_hook: bool = False):
    """The same layout built without a counter: DDP's built-in all-reduce (or torch's Python
    ``allreduce_hook``), FSDP's default comms, no TP hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from scalerl.parallel.data_parallel import apply_ddp, apply_fsdp
    from scalerl.parallel.parallelize import ModuleParts
    from scalerl.parallel.tensor_parallel import apply_tensor_parallel

    if layout == "ddp":
        hook = dict(comm_hook=allreduce_hook, hook_state=ctx.dp_mesh.get_group()) if python_hook else {}
        return ModuleParts(model, apply_ddp(model, ctx.dp_mesh, **hook))
    if layout == "fsdp":
        return ModuleParts(model, apply_fsdp(model, ctx.fsdp_mesh))
    apply_tensor_parallel(model, ctx.mesh["tp"])
    return ModuleParts(model, model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from scalerl.core.net import free_port

    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), args, results), nprocs=2, start_method="spawn")
    results = dict(results)
    print(f"forward + backward, 2 gloo ranks, hidden {args.hidden}, {args.layers} layers, 4 x {args.tokens} tokens; "
          f"median of {args.iters}, slower rank")
    for layout, times in results.items():
        base = times["uncounted"]
        cells = ", ".join(f"{v} {t * 1e3:.1f} ms ({t / base:.2f}x)" for v, t in times.items())
        print(f"{layout:5} {cells}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
