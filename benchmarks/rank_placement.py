"""Data-parallel all-reduce time with the launcher's interleaved rank order and with scalerl's node order.

    python benchmarks/rank_placement.py [--rate-mbit 200] [--size-mb 16] [--repeats 3] [--json FILE]

Runs on the emulated network (`scalerl.launch.emulated_cluster`: 2 nodes joined by a tc-shaped link, needs
root and iproute2) with 2 ranks per node launched *interleaved* (rank r on node r % 2), as a launcher with
the wrong order would. Every rank calls `init_distributed` (which sees the interleaving in the gathered
topology and builds the mesh in node order) and also builds the mesh in the launcher's order; both DP
groups then all-reduce the same tensor, alternating, best of ``--repeats`` (the slowest rank's time).
Both move the same bytes (counted below); the node-order ring crosses the link 2 times instead of 4.
The ratio printed compares the two in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RANK_SCRIPT = r"""
import json, sys, time
import torch, torch.distributed as dist
from scalerl.comm.net.rank_placement import ring_crossings
from scalerl.core.config import ParallelSection
from scalerl.parallel.distributed import init_distributed

size_mb, repeats = float(sys.argv[1]), int(sys.argv[2])
ctx = init_distributed(ParallelSection(dp_replicate=-1), torch.device("cpu"))  # node order (the default)
_, launcher_dp = ctx.dims.build_mesh("cpu")  # the launcher's order
groups = {"launcher order": launcher_dp.get_group(), "node order": ctx.dp_group}
tensor = torch.ones(int(size_mb * 2**20) // 4)
for group in groups.values():
    dist.all_reduce(tensor, group=group)  # connections up before timing
times = {name: [] for name in groups}
counted = {}
for _ in range(repeats):
    for name, group in groups.items():
        ctx.comm.reset()
        dist.barrier()
        start = time.perf_counter()
        with ctx.comm.collective("grad", "all_reduce", tensor, group):
            dist.all_reduce(tensor, group=group)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends when the slowest rank is done
        times[name].append(float(elapsed))
        counted[name] = ctx.comm.bytes_by("grad")
nodes = ctx.cluster.node_of_rank
rings = {name: dist.get_process_group_ranks(group) for name, group in groups.items()}
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({
        "best_s": {name: min(t) for name, t in times.items()}, "times_s": times, "bytes_sent_per_rank": counted,
        "rings": rings, "crossings": {name: ring_crossings(r, nodes) for name, r in rings.items()},
        "nodes": nodes, "placement_notes": list(ctx.placement.notes)}), flush=True)
dist.destroy_process_group()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=200, help="inter-node link rate")
    parser.add_argument("--size-mb", type=float, default=16, help="all-reduced tensor, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from scalerl.launch.emulated_cluster import EmulatedCluster, EmulatedClusterError

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK_SCRIPT)
        try:
            with EmulatedCluster(nodes=2, rate_mbit=args.rate_mbit) as cluster:
                results = cluster.run_ranks([sys.executable, str(script), str(args.size_mb), str(args.repeats)],
                                            ranks_per_node=2, placement="interleaved",
                                            env={"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, timeout_s=600)
        except EmulatedClusterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    failed = [r for r in results if r.returncode != 0]
    if failed:
        for r in failed:
            print(f"rank {r.rank} {r.describe()}:\n{r.output}", file=sys.stderr)
        return 1
    line = next(x for x in results[0].output.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result.update(rate_mbit=args.rate_mbit, size_mb=args.size_mb, repeats=args.repeats)
    best = result["best_s"]
    print(f"2 nodes x 2 ranks launched interleaved (nodes by rank: {result['nodes']}), link {args.rate_mbit:g} "
          f"Mbit/s, all_reduce of {args.size_mb:g} MiB over the 4-rank DP group, best of {args.repeats}")
    for note in result["placement_notes"]:
        print(f"  init_distributed: {note}")
    print(f"{'mesh order':16} {'ring':14} {'link crossings':>14} {'bytes sent/rank':>16} {'best s':>8}")
    for name in best:
        print(f"{name:16} {str(result['rings'][name]):14} {result['crossings'][name]:>14} "
              f"{result['bytes_sent_per_rank'][name]:>16.0f} {best[name]:>8.3f}")
    ratio = best["node order"] / best["launcher order"]
    result["ratio_node_over_launcher"] = ratio
    print(f"node order / launcher order: {ratio:.2f} (target: about 0.5)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
