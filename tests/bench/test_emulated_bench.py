"""The bench on emulated nodes (network namespaces joined by a link shaped at 100 Mbit/s): a DDP cell on 2
nodes, its link probed and fitted, and the cost model's projection of its communication time checked
against the measurement. Needs root and iproute2 (skips and says so otherwise)."""

from __future__ import annotations

import io

from scalerl.bench.matrix import BenchMatrix
from scalerl.bench.run import run_bench
from scalerl.launch.emulated_cluster import list_namespaces

RATE_MBIT = 100


def test_ddp_on_two_emulated_nodes(netns_ok, tmp_path):
    before = set(list_namespaces())
    matrix = BenchMatrix(strategies=["ddp"], nodes=[2], rates_mbit=[RATE_MBIT], steps=3, warmup=1, baselines=False,
                         overrides=["rollout.max_new_tokens=8"])
    report = run_bench(matrix, tmp_path / "r.json", progress_stream=io.StringIO())
    assert set(list_namespaces()) <= before  # the emulated network is gone afterwards
    link = report["links"][f"2nodes@{RATE_MBIT}Mbit"]["inter"]
    # tbf at 100 Mbit/s: one stream carries 0.8-1.0 of the shaped rate (TCP/IP framing, the token bucket)
    assert 0.8 * RATE_MBIT / 8 * 1e6 <= link["bytes_per_s"] <= 1.0 * RATE_MBIT / 8 * 1e6
    cell = next(c for c in report["cells"] if c["id"] == f"ddp|2x1|{RATE_MBIT}M|none|default|colocated")
    assert cell["status"] == "ok", cell.get("reason")
    assert cell["scaling_reference"].startswith("single|") and 0 < cell["scaling_efficiency"] < 1
    assert report["baselines"] == {"cell": "single|1x1|0M|none|default|colocated"}  # baselines off
    (entry,) = report["validation"]
    # 6 MB of gradients per step over a 12.5 MB/s link: bandwidth-bound, so the alpha-beta time must hold
    assert entry["measured"]["comm_s"] > 0.3
    assert abs(entry["error"]["comm"]) < 0.25, entry
    assert abs(entry["error"]["bytes"]) < 0.01
