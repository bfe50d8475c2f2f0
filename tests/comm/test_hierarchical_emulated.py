"""The hierarchical all-reduce on an emulated network: 2 network-namespace nodes x 2 ranks, the link
shaped at 1 Gbit/s. Sums equal the flat all-reduce's exactly (integer-valued floats); the link carries
fewer bytes (per direction ~1.0 x S against the flat ring's 1.5 x S); `comm.allreduce=auto` picks
hierarchical when told the link's rate and stays flat, saying why, when the veth's rate is unknown.
Needs root and iproute2 (skips otherwise).
"""

import sys
from pathlib import Path

from scalerl.core.net import free_port
from scalerl.launch.emulated_cluster import (
    EmulatedCluster,
)
from tests.emulated_network import rank_reports

REPO = Path(__file__).resolve().parents[2]
SIZE = 2**20  # fp32 elements: 4 MiB

SCRIPT = f"""
import json, os
from pathlib import Path
import torch, torch.distributed as dist
from scalerl.comm.gradients.hierarchical import HierarchicalGroups, gather_node_layout, hierarchical_all_reduce
from scalerl.comm.gradients.setup import decide_allreduce

def tx():
    return int(Path("/sys/class/net/" + os.environ["GLOO_SOCKET_IFNAME"] + "/statistics/tx_bytes").read_text())

dist.init_process_group("gloo")
rank = dist.get_rank()
groups = HierarchicalGroups(gather_node_layout())
report = {{"rank": rank, "exact": []}}
for size, chunks in ((7, None), (1001, 3), ({SIZE}, None)):
    x = torch.randint(-1000, 1000, (size,), generator=torch.Generator().manual_seed(rank)).float()
    flat, hier = x.clone(), x.clone()
    dist.all_reduce(flat)
    hierarchical_all_reduce(hier, groups, chunks=chunks)
    report["exact"].append(torch.equal(flat, hier))
for name in ("flat", "hierarchical"):
    t = torch.ones({SIZE})
    dist.barrier()
    before = tx()
    dist.all_reduce(t) if name == "flat" else hierarchical_all_reduce(t, groups)
    dist.barrier()
    report[name + "_tx"] = tx() - before
told, _ = decide_allreduce("auto", dist.group.WORLD, "cpu", inter_node_mbit=200)
unknown, _ = decide_allreduce("auto", dist.group.WORLD, "cpu")
report["auto_told"] = [told.kind, told.reason]
report["auto_unknown"] = [unknown.kind, unknown.reason]
print("REPORT " + json.dumps(report), flush=True)
dist.destroy_process_group()
"""


def test_hierarchical_all_reduce_on_two_emulated_nodes(netns_ok, tmp_path):
    script = tmp_path / "hierarchical.py"
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with EmulatedCluster(nodes=2, rate_mbit=1000, master_port=free_port()) as cluster:
        results = cluster.run_ranks([sys.executable, str(script)], ranks_per_node=2, env=env, timeout_s=120)
    reports = rank_reports(results)
    for report in reports:
        assert report["exact"] == [True, True, True]
        assert report["auto_told"][0] == "hierarchical" and "comm.inter_node_mbit" in report["auto_told"][1]
        assert report["auto_unknown"][0] == "flat" and "unknown" in report["auto_unknown"][1]
    size = 4 * SIZE
    # Local rank 0 of each node reads its node's link (all traffic of the node leaves through it).
    for node_rank in (0, 2):
        flat, hier = reports[node_rank]["flat_tx"], reports[node_rank]["hierarchical_tx"]
        assert 1.5 * size <= flat < 1.6 * size, flat  # + TCP/IP headers
        assert 1.0 * size <= hier < 1.1 * size, hier
