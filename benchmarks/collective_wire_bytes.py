"""Bytes each rank really sends per collective, read from the emulated network's link counters, against
the formulas `scalerl.comm.counting.collective_bytes.wire_bytes` counts with.

    python benchmarks/collective_wire_bytes.py [--nodes 2] [--size-mb 4] [--backend gloo]

One rank per node (network namespaces, `scalerl.launch.emulated_cluster`; needs root and iproute2), so
every byte a rank sends leaves its node: each collective runs alone between two reads of every node's
transmit counter. Printed per collective: each node's bytes sent / S, the formula's, and their ratio
(TCP/IP headers and ACKs make it slightly above 1). Not a timing benchmark: the links are unshaped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"]

RANK_SCRIPT = r"""
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
sync, size, backend = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
dist.init_process_group(backend, timeout=timedelta(seconds=120))  # no collective hangs past it
n = dist.get_world_size()
elems = size // 4

def send():
    if rank == 0:
        dist.send(torch.ones(elems), dst=1)
    elif rank == 1:
        dist.recv(torch.empty(elems), src=0)

ops = {  # S: the reduced tensor / the gathered output / the scattered input / the broadcast or sent tensor
    "all_reduce": lambda: dist.all_reduce(torch.ones(elems)),
    "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(elems), torch.ones(elems // n)),
    "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(elems // n), torch.ones(elems)),
    "broadcast": lambda: dist.broadcast(torch.ones(elems), src=0),
    "send": send,
}

def wait_for(name):
    deadline = time.monotonic() + 120
    while not (sync / name).exists():
        assert time.monotonic() < deadline, f"rank {rank}: no {name} within 120 s"
        time.sleep(0.01)

for op in ops.values():  # connections up before measuring
    op()
    dist.barrier()
for name, op in ops.items():
    dist.barrier()
    (sync / f"ready_{name}_{rank}").touch(); wait_for(f"go_{name}")
    op()
    (sync / f"done_{name}_{rank}").touch(); wait_for(f"next_{name}")
dist.destroy_process_group()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--size-mb", type=float, default=4)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from scalerl.comm.counting.collective_bytes import wire_bytes
    from scalerl.launch.emulated_cluster import EmulatedCluster, EmulatedClusterError

    size = int(args.size_mb * 2**20) // (4 * args.nodes) * 4 * args.nodes  # divisible by the rank count
    n, sent = args.nodes, {}
    with tempfile.TemporaryDirectory() as tmp:
        sync = Path(tmp)
        (sync / "rank.py").write_text(RANK_SCRIPT)

        def wait(what, done):
            deadline = time.monotonic() + 120
            while not done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {what} within 120 s")
                time.sleep(0.01)

        try:
            with EmulatedCluster(nodes=n, rate_mbit=0) as cluster:
                group = cluster.start_ranks([sys.executable, str(sync / "rank.py"), tmp, str(size), args.backend],
                                            env={"PYTHONPATH": str(REPO)})
                for op in OPS:
                    wait(f"ranks ready for {op}", lambda: all((sync / f"ready_{op}_{r}").exists() for r in range(n)))
                    before = [cluster.link_counters(k)["tx_bytes"] for k in range(n)]
                    (sync / f"go_{op}").touch()
                    wait(op, lambda: all((sync / f"done_{op}_{r}").exists() for r in range(n)))
                    sent[op] = [cluster.link_counters(k)["tx_bytes"] - b for k, b in enumerate(before)]
                    (sync / f"next_{op}").touch()
                results = group.wait(timeout_s=120)
        except EmulatedClusterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if any(r.returncode for r in results):
        print("\n".join(f"rank {r.rank}: {r.describe()}\n{r.output}" for r in results), file=sys.stderr)
        return 1
    print(f"{args.backend}, {n} nodes x 1 rank, S = {size} bytes; bytes sent / S per rank (link counter | formula)")
    table = {}
    for op in OPS:
        formula = [wire_bytes("recv" if op == "send" and r != 0 else op, size, n, args.backend, group_rank=r) / size
                   for r in range(n)]
        measured = [b / size for b in sent[op]]
        table[op] = {"measured": measured, "formula": formula}
        cells = "  ".join(f"{m:.4f} | {f:.4f}" for m, f in zip(measured, formula))
        print(f"{op:15} {cells}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
