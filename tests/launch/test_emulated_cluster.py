"""The emulated multi-node network: ranks in network namespaces joined by tc-shaped links.

Needs root and iproute2 (skips and says so otherwise). Checks: a gloo all_reduce across 2 nodes x 2
ranks and across 3 nodes on a bridge; bytes over the shaped link match the ring all_reduce's count;
nothing is left behind after a failing rank, an exception, a timeout or SIGTERM to the CLI.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from scalerl.launch.emulated_cluster import (
    EmulatedCluster,
    EmulatedClusterError,
    cleanup_stale,
    list_namespaces,
    list_root_links,
    main,
    require_root_and_iproute2,
)
from scalerl.launch.emulated_ranks import RankTimeoutError, rank_layout
from tests.emulated_network import wait_until

REPO = Path(__file__).resolve().parents[2]
RANK_ENV = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}

ALL_REDUCE_SCRIPT = """
import json, os, socket
import torch, torch.distributed as dist
from scalerl.comm import choose_socket_interface, detect_topology
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
topo = detect_topology(detect_gpus=False)
iface = topo.interface(os.environ["GLOO_SOCKET_IFNAME"])
choice = choose_socket_interface(os.environ["MASTER_ADDR"], topo, os.environ)
print(json.dumps({"rank": dist.get_rank(), "sum": t.item(), "iface": iface.name, "kind": iface.virtual_kind,
                  "ipv4": iface.ipv4, "choice": choice.name}))
dist.destroy_process_group()
"""

# Bytes over the link: warm up (connections, rendezvous), then wait for the test to read the counters,
# all_reduce S bytes, and say so; the test reads the counters again before letting the ranks exit.
MEASURED_ALL_REDUCE_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
sync, rank = Path(sys.argv[1]), os.environ["RANK"]
def wait_for(path):
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"rank {rank}: no {path.name} within 60 s"
        time.sleep(0.01)
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1024)); dist.barrier()
(sync / f"ready{rank}").touch(); wait_for(sync / "go")
t = torch.ones(4 * 2**20 // 4)
dist.all_reduce(t)
assert t[0].item() == 2.0
(sync / f"done{rank}").touch(); wait_for(sync / "exit")
dist.destroy_process_group()
"""


def leftovers(prefix: str) -> list[str]:
    return [n for n in list_namespaces() + list_root_links() if n.startswith(prefix)]


def pids_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue  # exited meanwhile
    return found


def test_rank_layout_grouped_and_interleaved():
    assert rank_layout(2, 2, "grouped") == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert rank_layout(2, 2, "interleaved") == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    with pytest.raises(ValueError, match="placement"):
        rank_layout(2, 2, "random")


def test_needs_root_and_iproute2_says_what_to_do(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr("shutil.which", lambda tool: None)
    with pytest.raises(EmulatedClusterError, match=r"run as root.*apt-get install -y --no-install-recommends "
                                                   r"iproute2"):
        require_root_and_iproute2()


def test_two_nodes_two_ranks_all_reduce(netns_ok, tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    with EmulatedCluster(nodes=2, rate_mbit=200) as cluster:
        results = cluster.run_ranks([sys.executable, str(script)], ranks_per_node=2, env=RANK_ENV, timeout_s=60)
        reports = [json.loads(r.output.strip().splitlines()[-1]) for r in results]
        assert [r.returncode for r in results] == [0, 0, 0, 0], [r.output for r in results]
        for r, report in zip(results, reports):
            assert report["sum"] == 10.0
            assert r.node == r.rank // 2  # grouped
            assert report["iface"] == report["choice"] == cluster.iface(r.node)
            assert report["kind"] == "veth" and report["ipv4"] == [f"{cluster.node_addr(r.node)}/24"]
        prefix = cluster.prefix
    assert leftovers(prefix) == []


def test_bytes_over_the_link_match_ring_all_reduce(netns_ok, tmp_path):
    script = tmp_path / "measured.py"
    script.write_text(MEASURED_ALL_REDUCE_SCRIPT)
    size = 4 * 2**20
    expected = 2 * (2 - 1) / 2 * size  # ring: each rank sends 2(n-1)/n x S, here over the link
    with EmulatedCluster(nodes=2, rate_mbit=200) as cluster:
        group = cluster.start_ranks([sys.executable, str(script), str(tmp_path)], ranks_per_node=1, env=RANK_ENV)
        wait_until(lambda: all((tmp_path / f"ready{r}").exists() for r in range(2)), 60, "both ranks ready")
        before = [cluster.link_counters(k) for k in range(2)]
        (tmp_path / "go").touch()
        wait_until(lambda: all((tmp_path / f"done{r}").exists() for r in range(2)), 60, "the all_reduce")
        after = [cluster.link_counters(k) for k in range(2)]
        (tmp_path / "exit").touch()
        results = group.wait(timeout_s=30)
        assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    ratios = {f"node{k} {d}": (after[k][f"{d}_bytes"] - before[k][f"{d}_bytes"]) / expected
              for k in range(2) for d in ("tx", "rx")}
    print(f"bytes over the link / ring all_reduce's {expected:.0f}: "
          + ", ".join(f"{name} {ratio:.4f}" for name, ratio in ratios.items()))
    for name, ratio in ratios.items():
        # TCP/IP headers and ACKs; veth counts GSO segments (one header per up to 64 KB): 1.0025 measured here
        assert 1.0 <= ratio < 1.10, (name, ratio)


def test_cleanup_after_failing_rank_timeout_and_exception(netns_ok):
    marker = f"srl-test-{uuid.uuid4().hex}"
    fail_rank_1 = [sys.executable, "-c", f"import os, sys, time; '{marker}'; "
                                         "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"]
    sleep = [sys.executable, "-c", f"import time; '{marker}'; time.sleep(60)"]
    with EmulatedCluster(nodes=2, rate_mbit=200) as cluster:
        results = cluster.run_ranks(fail_rank_1, timeout_s=30)
        assert [(r.returncode, r.killed) for r in results] == [(-signal.SIGTERM, True), (3, False)]
        assert results[1].describe() == "exited with 3"
        with pytest.raises(RankTimeoutError, match=r"rank\(s\) 0 \(node 0\), 1 \(node 1\) did not finish within 1 s"):
            cluster.run_ranks(sleep, timeout_s=1)
        assert pids_with_marker(marker) == []
    assert leftovers(cluster.prefix) == []

    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(nodes=3, rate_mbit=200) as cluster:
            cluster.start_ranks(sleep)
            wait_until(lambda: len(pids_with_marker(marker)) == 3, 20, "3 sleeping ranks")
            raise RuntimeError("boom")
    assert leftovers(cluster.prefix) == []
    assert pids_with_marker(marker) == []


def test_cleanup_after_sigint_in_process(netns_ok):
    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with EmulatedCluster(nodes=2, rate_mbit=200) as cluster:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt before this ends
    assert leftovers(cluster.prefix) == []
    assert signal.getsignal(signal.SIGINT) is previous


def test_cleanup_after_sigterm_to_the_cli(netns_ok):
    marker = f"srl-test-{uuid.uuid4().hex}"
    cli = subprocess.Popen([sys.executable, "-m", "scalerl.launch.emulated_cluster", "--nodes", "2",
                            "--ranks-per-node", "2", "--", sys.executable, "-c", f"import time; '{marker}'; "
                            "time.sleep(60)"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    prefix = f"srl{cli.pid}r"
    try:
        ranks = lambda: [pid for pid in pids_with_marker(marker) if pid != cli.pid]  # noqa: E731 (the CLI's argv has it)
        wait_until(lambda: len(ranks()) == 4, 30, "the CLI's 4 ranks to start")
        assert len(leftovers(prefix)) == 2  # two namespaces, the veth pair lives inside them
        cli.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        cli.send_signal(signal.SIGTERM)  # a second one, likely during the cleanup, must not cut it short
        _, stderr = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:  # the test failed before the CLI could clean up: do it for it
            cli.kill()
            cli.wait(timeout=30)
            cleanup_stale()
    assert cli.returncode == 128 + signal.SIGTERM, stderr
    assert leftovers(prefix) == [] and pids_with_marker(marker) == []


def test_cleanup_stale_removes_only_dead_runs(netns_ok):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale_ns, stale_bridge, live_ns = f"srl{dead.pid}r0n0", f"srl{dead.pid}r0br", f"srl{os.getpid()}r99n0"
    subprocess.run(["ip", "netns", "add", stale_ns], check=True, timeout=15)
    subprocess.run(["ip", "link", "add", stale_bridge, "type", "bridge"], check=True, timeout=15)
    subprocess.run(["ip", "netns", "add", live_ns], check=True, timeout=15)
    try:
        assert sorted(cleanup_stale()) == sorted([stale_ns, stale_bridge])
        assert live_ns in list_namespaces() and stale_ns not in list_namespaces()
        assert main(["--cleanup"]) == 0  # nothing left to remove, and says so
    finally:
        subprocess.run(["ip", "netns", "del", live_ns], check=False, timeout=15)


def test_three_nodes_on_a_bridge(netns_ok, tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    with EmulatedCluster(nodes=3, rate_mbit=200) as cluster:
        assert cluster.bridge in list_root_links()
        results = cluster.run_ranks([sys.executable, str(script)], env=RANK_ENV, timeout_s=60)
        assert [r.returncode for r in results] == [0, 0, 0], [r.output for r in results]
        reports = [json.loads(r.output.strip().splitlines()[-1]) for r in results]
        assert [r["sum"] for r in reports] == [6.0] * 3
        assert sorted(r["ipv4"][0] for r in reports) == [f"{cluster.node_addr(k)}/24" for k in range(3)]
    assert leftovers(cluster.prefix) == []
