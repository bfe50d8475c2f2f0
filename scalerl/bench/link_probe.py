"""Link calibration inside a cell's network: ``python -m scalerl.bench.link_probe SPEC.json`` on every rank.

All-reduce sweeps (per size, the median of the slowest rank's time over repetitions) between the first
ranks of the first two nodes (one stream over the inter-node link) and among the ranks of node 0 (its
loopback), written by rank 0 as ``probe.json``; the runner fits alpha and beta to them
(`scalerl.bench.cost_model.collective_cost.fit_link`).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

SIZES = (4 * 2**10, 16 * 2**10, 64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20)
SMALL_ITERS, LARGE_ITERS = 15, 5  # small messages are cheap and noisy: more of them


def _collective(op: str, whole, part, group) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(whole, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(whole, part, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(part, whole, group=group)
    else:
        raise ValueError(f"timed_sweep times all_reduce, all_gather or reduce_scatter, not {op!r}")


def timed_sweep(group, group_size: int, sizes: list[int], op: str = "all_reduce") -> list[dict]:
    """Per size (the collective's payload: the whole tensor): the median over repetitions of the slowest
    rank's time of one ``op`` (each preceded by a barrier, so a late rank's arrival is not counted), after one
    untimed warm-up. ``op``: ``all_reduce``, or ``all_gather`` / ``reduce_scatter`` as FSDP calls them (into
    and out of one flat tensor), whose time on gloo is not the all-reduce's share of the bytes."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    results = []
    for size in sizes:
        elems = max(group_size, size // 4 // group_size * group_size)
        buf = torch.ones(elems, dtype=torch.float32)
        part = torch.ones(elems // group_size, dtype=torch.float32)
        _collective(op, buf, part, group)
        times = []
        for _ in range(SMALL_ITERS if size < 2**18 else LARGE_ITERS):
            dist.barrier(group=group)
            start = time.perf_counter()
            _collective(op, buf, part, group)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            times.append(float(elapsed))
        results.append({"size": size, "time_s": statistics.median(times), "min_s": min(times), "n": len(times)})
    return results


def run(spec: dict) -> int:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=float(spec.get("timeout_s", 300))))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        per_node = int(spec["ranks_per_node"])
        nodes = world // per_node
        sizes = list(spec.get("sizes") or SIZES)
        out: dict = {"sizes": sizes}
        if nodes >= 2:  # every rank creates every group, in the same order
            pair = [0, per_node]
            inter = dist.new_group(pair)
            if rank in pair:
                out["inter"] = {"p": 2, "results": timed_sweep(inter, 2, sizes)}
        if per_node >= 2:
            local = list(range(per_node))
            intra = dist.new_group(local)
            if rank in local:
                out["intra"] = {"p": per_node, "results": timed_sweep(intra, per_node, sizes)}
        dist.barrier()
        if rank == 0:
            path = Path(spec["out_dir"]) / "probe.json"
            path.write_text(json.dumps(out))
        return 0
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m scalerl.bench.link_probe SPEC.json", file=sys.stderr)
        return 2
    return run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main())
