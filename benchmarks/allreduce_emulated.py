"""All-reduce on an emulated two-node network: flat vs hierarchical vs hierarchical + bf16 / + top-k.

    python benchmarks/allreduce_emulated.py [--sizes-mib 4 16 64] [--rate-mbit 200] [--repeats 3]

Needs root and iproute2 (network namespaces). Builds 2 nodes x 2 ranks (`EmulatedCluster`, grouped
placement, the inter-node veth shaped with tbf at --rate-mbit on both ends; ranks of a node talk over
their own address, unshaped) and runs, for each size S of fp32 data:

- flat: `dist.all_reduce` over the 4 ranks (gloo's ring);
- hierarchical: `hierarchical_all_reduce` (intra-node reduce-scatter, inter-node all-reduce of each half,
  intra-node all-gather; pipelined in 4 MiB chunks);
- hier+bf16: the same with the inter-node all-reduce in bf16;
- hier+topk: the same with the inter-node step a top-k exchange (density --density, error feedback; the
  `TopKExchange` the DDP hook uses).

Time per op: the slowest rank's, best of --repeats (a barrier before each). Printed per variant: time,
algbw = S / time, busbw = algbw x 2(n-1)/n (nccl-tests' definitions, n = 4; for compressed variants S is
the uncompressed size), bytes the busiest node's link sent (kernel counter of the veth, TCP/IP headers
included), the fraction of the shaped rate those bytes needed (link bytes x 8 / time / rate), and the
speed-up over flat measured in the same run. Targets: hierarchical >= 1.3x flat; the link at >= 80%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("flat", "hierarchical", "hier+bf16", "hier+topk")
TARGET_SPEEDUP, TARGET_LINK_FRACTION = 1.3, 0.8


def _link_tx_bytes() -> int:
    """Bytes this node's inter-node interface has sent (its namespace's own sysfs)."""
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def worker(sizes_mib: list[int], repeats: int, density: float) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from scalerl.comm.counting.counted_collectives import CountedCollectives
    from scalerl.comm.gradients.bucket_slots import Segment
    from scalerl.comm.gradients.hierarchical import (
        HierarchicalGroups,
        gather_node_layout,
        hierarchical_all_reduce,
    )
    from scalerl.comm.gradients.topk import TopKExchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = HierarchicalGroups(gather_node_layout())
    topk = TopKExchange()

    def run(variant: str, t: torch.Tensor) -> None:
        if variant == "flat":
            dist.all_reduce(t)
        elif variant == "hierarchical":
            hierarchical_all_reduce(t, groups)
        elif variant == "hier+bf16":
            hierarchical_all_reduce(t, groups, inter_dtype=torch.bfloat16)
        else:
            start, end = groups.shard_bounds(t.numel())
            segments = [Segment(0, 0, min(end, t.numel()) - start)]
            hierarchical_all_reduce(t, groups, inter_reduce=lambda shard: topk.reduce(
                shard, segments, [density], groups.inter, CountedCollectives(), (t.numel(), "bench"), "inter"))

    for variant in VARIANTS:  # connections and first-call costs out of the way
        run(variant, torch.ones(2**18))
    results = []
    for size_mib in sizes_mib:
        numel = size_mib * 2**20 // 4
        for variant in VARIANTS:
            best = None
            for _ in range(repeats):
                t = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
                dist.barrier()
                tx0 = _link_tx_bytes() if groups.local_rank == 0 else 0
                start = time.perf_counter()
                run(variant, t)
                elapsed = time.perf_counter() - start
                dist.barrier()
                tx = (_link_tx_bytes() - tx0) if groups.local_rank == 0 else 0
                stats = torch.tensor([elapsed, float(tx)], dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # slowest rank; busiest node's link
                if best is None or stats[0] < best[0]:
                    best = stats.tolist()
            results.append({"size_mib": size_mib, "variant": variant, "seconds": best[0], "link_bytes": best[1]})
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "results": results}), flush=True)
    dist.destroy_process_group()


def report(data: dict, rate_mbit: float) -> list[dict]:
    n = data["world"]
    rows = []
    by_size: dict[int, dict[str, dict]] = {}
    for r in data["results"]:
        by_size.setdefault(r["size_mib"], {})[r["variant"]] = r
    print(f"{'size':>7s} {'variant':>13s} {'time s':>8s} {'algbw MB/s':>10s} {'busbw MB/s':>10s} "
          f"{'link MB':>8s} {'link %':>7s} {'vs flat':>8s}")
    for size, variants in sorted(by_size.items()):
        flat = variants["flat"]["seconds"]
        for name in VARIANTS:
            r = variants[name]
            size_bytes = size * 2**20
            algbw = size_bytes / r["seconds"] / 1e6
            busbw = algbw * 2 * (n - 1) / n
            link_fraction = r["link_bytes"] * 8 / r["seconds"] / (rate_mbit * 1e6)
            speedup = flat / r["seconds"]
            rows.append({**r, "algbw_MBps": algbw, "busbw_MBps": busbw, "link_fraction": link_fraction,
                         "speedup_vs_flat": speedup})
            print(f"{size:>4d}MiB {name:>13s} {r['seconds']:8.3f} {algbw:10.1f} {busbw:10.1f} "
                  f"{r['link_bytes'] / 1e6:8.1f} {link_fraction:7.1%} {speedup:7.2f}x")
    hier = [r for r in rows if r["variant"] == "hierarchical"]
    worst = min(r["speedup_vs_flat"] for r in hier)
    link = min(r["link_fraction"] for r in rows if r["variant"] in ("flat", "hierarchical"))
    print(f"\nhierarchical vs flat: {worst:.2f}x at worst (target >= {TARGET_SPEEDUP}x: "
          f"{'met' if worst >= TARGET_SPEEDUP else 'NOT met'}); link driven at >= {link:.0%} of {rate_mbit:g} Mbit/s "
          f"by flat and hierarchical (target >= {TARGET_LINK_FRACTION:.0%}: "
          f"{'met' if link >= TARGET_LINK_FRACTION else 'NOT met'})")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rate-mbit", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--density", type=float, default=0.01, help="top-k density of the inter-node step")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.sizes_mib, args.repeats, args.density)
        return 0
    sys.path.insert(0, str(REPO))
    from scalerl.core.net import free_port
    from scalerl.launch.emulated_cluster import EmulatedCluster

    argv_worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "--repeats", str(args.repeats),
                   "--density", str(args.density), "--sizes-mib", *map(str, args.sizes_mib)]
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with EmulatedCluster(nodes=2, rate_mbit=args.rate_mbit, master_port=free_port()) as cluster:
        print(f"emulated cluster: 2 nodes x 2 ranks, inter-node link {args.rate_mbit:g} Mbit/s (tbf), "
              f"sizes {args.sizes_mib} MiB, best of {args.repeats}", flush=True)
        results = cluster.run_ranks(argv_worker, ranks_per_node=2, env=env, timeout_s=args.timeout_s)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        for r in failed:
            print(f"rank {r.rank} {r.describe()}:\n{(r.output or '')[-3000:]}", file=sys.stderr)
        return 1
    line = next(l for l in (results[0].output or "").splitlines() if l.startswith("RESULT "))
    rows = report(json.loads(line[len("RESULT "):]), args.rate_mbit)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
