"""An emulated multi-node cluster on one machine: network namespaces as nodes, joined by shaped links.

Two nodes share a veth pair; three or more hang off a bridge in the root namespace. Every inter-node
link is shaped with `tc tbf` on both ends (tbf shapes egress only), so collectives that cross nodes run
at a real network's pace while ranks on one node talk over their own address unshaped. Needs root and
iproute2. Names carry a per-run prefix `srl<pid>r<seq>` so concurrent runs never collide and leftovers
of dead runs can be told apart (`cleanup_stale`). Only the namespaces' own addresses are ever used.

    with EmulatedCluster(nodes=2, rate_mbit=200) as cluster:
        results = cluster.run_ranks(["python", "train.py"], ranks_per_node=2, timeout_s=300)

CLI: `python -m scalerl.launch.emulated_cluster --nodes 2 --ranks-per-node 2 -- python train.py`.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from scalerl.launch.emulated_ranks import (
    RankGroup,
    RankResult,
    RankTimeoutError,
    rank_layout,
)

PREFIX = "srl"
RUN_NAME = re.compile(rf"^{PREFIX}(\d+)r(\d+)(n\d+|h\d+|e\d+|br)$")  # pid, sequence number, part
IP_TIMEOUT_S = 15.0
CLEANUP_WAIT_S = 10.0
_run_sequence = itertools.count()


class EmulatedClusterError(RuntimeError):
    """The emulated network could not be built, used or removed; the message says which step."""


def require_root_and_iproute2() -> None:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces, veths and tc need CAP_NET_ADMIN): run as root")
    absent = [f"`{tool}`" for tool in ("ip", "tc") if shutil.which(tool) is None]
    if absent:
        missing.append(f"{' and '.join(absent)} from iproute2: apt-get install -y --no-install-recommends iproute2")
    if missing:
        raise EmulatedClusterError("the emulated cluster needs " + "; ".join(missing))


def run_tool(argv: list[str], what: str) -> str:
    """Run `ip` / `tc` (never through a shell); raise naming the step and the tool's message."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise EmulatedClusterError(f"{what}: `{' '.join(argv)}` took over {IP_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        raise EmulatedClusterError(f"{what}: `{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in run_tool(["ip", "netns", "list"], "list namespaces").splitlines() if line]


def list_root_links() -> list[str]:
    return [link["ifname"] for link in json.loads(run_tool(["ip", "-j", "link", "show"], "list links") or "[]")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove namespaces and root-namespace links of runs whose process is gone; returns their names.
    (A recycled pid keeps a dead run's leftovers until that process ends too.)"""
    require_root_and_iproute2()
    removed = []
    for name in list_root_links():
        match = RUN_NAME.match(name)
        if match and match.group(3)[0] in "hb" and not _pid_alive(int(match.group(1))):
            if _delete(["ip", "link", "del", name]):
                removed.append(name)
    for name in list_namespaces():
        match = RUN_NAME.match(name)
        if match and match.group(3).startswith("n") and not _pid_alive(int(match.group(1))):
            if _delete(["ip", "netns", "del", name]):
                removed.append(name)
    return removed


def _delete(argv: list[str]) -> bool:
    """Best-effort delete: something else may have removed it in the meantime."""
    return subprocess.run(argv, capture_output=True, timeout=IP_TIMEOUT_S, check=False).returncode == 0


def _signal_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


@dataclass(frozen=True)
class LinkShape:
    rate_mbit: float  # 0: unshaped
    burst: str = "256kb"  # tbf bucket; 256 kB kept 1 Gbit links at 83-95% of rate here
    latency_ms: int = 50  # longest a packet may wait in the tbf queue before being dropped


class EmulatedCluster:
    """Context manager: builds the nodes on entry, removes everything on exit, exception or signal."""

    def __init__(self, nodes: int = 2, rate_mbit: float = 200, burst: str = "256kb", latency_ms: int = 50,
                 master_port: int = 29500):
        if not 2 <= nodes <= 16:
            raise ValueError(f"nodes must be 2..16, got {nodes}")
        self.nodes = nodes
        self.shape = LinkShape(rate_mbit, burst, latency_ms)
        self.master_port = master_port
        self.prefix = f"{PREFIX}{os.getpid()}r{next(_run_sequence) % 100}"
        # A private /24 per run in 10.192-255.x.0 (nodes live in their own namespaces, so it cannot clash
        # with the host's routes; distinct per run only to keep concurrent runs' logs apart).
        index = (os.getpid() * 100 + int(self.prefix.rsplit("r", 1)[1])) % (64 * 256)
        self.subnet = ipaddress.IPv4Network(f"10.{192 + index // 256}.{index % 256}.0/24")
        self._groups: list[RankGroup] = []
        self._log_dir: str | None = None
        self._previous_handlers: dict[int, object] = {}
        self._stopping = False  # a signal arrived or cleanup began: later signals wait until it is done
        self._deferred_signal: int | None = None

    # ---- names and addresses ----
    def namespace(self, k: int) -> str:
        return f"{self.prefix}n{k}"

    def iface(self, k: int) -> str:
        """The node's end of its inter-node link, inside its namespace (GLOO_SOCKET_IFNAME there)."""
        return f"{self.prefix}e{k}"

    def host_iface(self, k: int) -> str:
        return f"{self.prefix}h{k}"

    @property
    def bridge(self) -> str | None:
        return f"{self.prefix}br" if self.nodes > 2 else None

    def node_addr(self, k: int) -> str:
        return str(self.subnet.network_address + k + 1)

    def exec_argv(self, k: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(k), *argv]

    def link_counters(self, k: int) -> dict[str, int]:
        """Bytes the node's link interface has sent and received so far (kernel counters, all traffic)."""
        out = run_tool(["ip", "-n", self.namespace(k), "-s", "-j", "link", "show", "dev", self.iface(k)],
                       f"read link counters of node {k}")
        link = json.loads(out)[0]
        stats = link.get("stats64") or link["stats"]  # older iproute2 names it "stats"
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]}

    # ---- lifetime ----
    def __enter__(self) -> EmulatedCluster:
        require_root_and_iproute2()
        self._install_signal_handlers()
        try:
            cleanup_stale()
            self._build()
        except BaseException:
            self.cleanup()
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.cleanup(raise_errors=exc_type is None)
        finally:
            self._restore_signal_handlers()
        if self._deferred_signal is not None and exc_type is None:
            raise _signal_exception(self._deferred_signal)  # a Ctrl-C pressed during cleanup still stops

    def _build(self) -> None:
        ns = [self.namespace(k) for k in range(self.nodes)]
        for k, name in enumerate(ns):
            run_tool(["ip", "netns", "add", name], f"create node {k}")
            run_tool(["ip", "-n", name, "link", "set", "lo", "up"], f"bring up lo on node {k}")
        if self.bridge is None:
            run_tool(["ip", "link", "add", self.iface(0), "netns", ns[0], "type", "veth", "peer", "name",
                      self.iface(1), "netns", ns[1]], "create the veth pair between node 0 and node 1")
        else:
            run_tool(["ip", "link", "add", self.bridge, "type", "bridge"], "create the bridge")
            self._quiet_up([], self.bridge)
            for k, name in enumerate(ns):
                run_tool(["ip", "link", "add", self.host_iface(k), "type", "veth", "peer", "name", self.iface(k),
                          "netns", name], f"create the veth from the bridge to node {k}")
                run_tool(["ip", "link", "set", self.host_iface(k), "master", self.bridge], f"attach node {k}")
                self._quiet_up([], self.host_iface(k))
                self._shape([], self.host_iface(k))  # bridge -> node direction
        for k, name in enumerate(ns):
            run_tool(["ip", "-n", name, "addr", "add", f"{self.node_addr(k)}/{self.subnet.prefixlen}", "dev",
                      self.iface(k)], f"address node {k}")
            self._quiet_up(["-n", name], self.iface(k))
            self._shape(["-n", name], self.iface(k))  # node -> peer / bridge direction

    def _quiet_up(self, netns: list[str], dev: str) -> None:
        # No IPv6 link-local address: no DAD / router-solicitation packets polluting the byte counters.
        run_tool(["ip", *netns, "link", "set", "dev", dev, "addrgenmode", "none"], f"disable IPv6 on {dev}")
        run_tool(["ip", *netns, "link", "set", "dev", dev, "up"], f"bring up {dev}")

    def _shape(self, netns: list[str], dev: str) -> None:
        if self.shape.rate_mbit > 0:
            run_tool(["tc", *netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.shape.rate_mbit:g}mbit",
                      "burst", self.shape.burst, "latency", f"{self.shape.latency_ms}ms"], f"shape {dev}")

    def cleanup(self, raise_errors: bool = False) -> None:
        """Kill this run's ranks, delete its links, bridge and namespaces, and check they are gone."""
        self._stopping = True
        for group in self._groups:
            group.kill()
        ours = [n for n in list_root_links() if self._is_ours(n)]
        for name in sorted(ours, key=lambda n: n.endswith("br")):  # veths before the bridge
            _delete(["ip", "link", "del", name])
        for name in list_namespaces():
            if self._is_ours(name):
                _delete(["ip", "netns", "del", name])
        if self._log_dir:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        deadline = time.monotonic() + CLEANUP_WAIT_S
        while (left := self._leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            message = f"emulated cluster {self.prefix}: still present {CLEANUP_WAIT_S:.0f} s after cleanup: {left}"
            if raise_errors:
                raise EmulatedClusterError(message)
            print(message, file=sys.stderr)

    def _leftovers(self) -> list[str]:
        return [n for n in list_namespaces() + list_root_links() if self._is_ours(n)]

    def _is_ours(self, name: str) -> bool:
        match = RUN_NAME.match(name)  # exact run: srl12r1 must not claim srl12r10's names
        return bool(match) and f"{PREFIX}{match.group(1)}r{match.group(2)}" == self.prefix

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python only delivers signals to the main thread; the caller's handlers stay
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        # Only the first signal unwinds (through __exit__, which cleans up); one arriving while that runs
        # must not cut the cleanup short and leave namespaces behind: __exit__ raises it afterwards.
        if self._stopping:
            self._deferred_signal = self._deferred_signal or signum
            return
        self._stopping = True
        raise _signal_exception(signum)


    # ---- ranks ----
    def start_ranks(self, argv: list[str], ranks_per_node: int = 1, env: dict[str, str] | None = None,
                    placement: str = "grouped", capture: bool = True) -> RankGroup:
        """Start nodes x ranks_per_node processes, each inside its node's namespace with the rank variables
        set. placement "grouped": node k holds ranks k*rpn..; "interleaved": rank r sits on node r % nodes."""
        if capture and self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix=f"{self.prefix}-logs-")
        procs = []
        world = self.nodes * ranks_per_node
        for rank, node, local_rank in rank_layout(self.nodes, ranks_per_node, placement):
            rank_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                        "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(node), "NODE_RANK": str(node),
                        "MASTER_ADDR": self.node_addr(0), "MASTER_PORT": str(self.master_port),
                        "GLOO_SOCKET_IFNAME": self.iface(node)}
            procs.append((rank, node, self.exec_argv(node, argv), rank_env))
        group = RankGroup.start(procs, self._log_dir if capture else None)
        self._groups.append(group)
        return group

    def run_ranks(self, argv: list[str], ranks_per_node: int = 1, env: dict[str, str] | None = None,
                  placement: str = "grouped", timeout_s: float = 600, capture: bool = True) -> list[RankResult]:
        """start_ranks, then wait; on timeout every rank is killed and RankTimeoutError names the stuck ones."""
        return self.start_ranks(argv, ranks_per_node, env, placement, capture).wait(timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scalerl.launch.emulated_cluster", description=__doc__.split(
        "\n\n")[0], epilog="Example: --nodes 2 --ranks-per-node 2 --rate-mbit 200 -- python my_script.py")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--rate-mbit", type=float, default=200, help="inter-node link rate; 0 leaves it unshaped")
    parser.add_argument("--burst", default="256kb")
    parser.add_argument("--latency-ms", type=int, default=50)
    parser.add_argument("--placement", choices=("grouped", "interleaved"), default="grouped")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--timeout-s", type=float, default=3600, help="kill all ranks after this long")
    parser.add_argument("--cleanup", action="store_true", help="only remove leftovers of dead runs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if args.cleanup:
            removed = cleanup_stale()
            print(f"removed {len(removed)} leftover(s): {' '.join(removed) or '-'}", file=sys.stderr)
            return 0
        if not command:
            parser.error("give the command to run after --")
        with EmulatedCluster(args.nodes, args.rate_mbit, args.burst, args.latency_ms, args.master_port) as cluster:
            print(f"emulated cluster {cluster.prefix}: {args.nodes} nodes "
                  f"{', '.join(cluster.node_addr(k) for k in range(args.nodes))}, links "
                  f"{f'{args.rate_mbit:g} Mbit/s' if args.rate_mbit else 'unshaped'}", file=sys.stderr, flush=True)
            results = cluster.run_ranks(command, args.ranks_per_node, placement=args.placement,
                                        timeout_s=args.timeout_s, capture=False)
    except RankTimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:  # the cluster is already cleaned up by now
        print("interrupted: ranks killed, emulated cluster removed", file=sys.stderr)
        return 130
    except EmulatedClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in results if r.returncode != 0]
    for r in failed:
        print(f"rank {r.rank} (node {r.node}) {r.describe()}", file=sys.stderr)
    return next((r.exit_status for r in failed if not r.killed), 1) if failed else 0


if __name__ == "__main__":
    sys.exit(main())
