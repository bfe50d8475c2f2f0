"""Starting a cell's ranks and collecting what they wrote: on this machine over loopback (one node), or inside
an emulated cluster (network namespaces joined by shaped links, `scalerl.launch.emulated_cluster`), one
cluster per node count and link rate, reused by every cell and link probe that needs it.

Each rank is ``python -m scalerl.bench.cell_rank SPEC.json`` (or ``link_probe``) with the rank variables
set, its output captured; when a rank fails the others are killed and the cell is reported failed with the
failing rank's output, and the matrix goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import scalerl
from scalerl.bench.cost_model.collective_cost import fit_error, fit_link
from scalerl.core.net import free_port
from scalerl.launch.emulated_cluster import EmulatedCluster
from scalerl.launch.emulated_ranks import (
    RankGroup,
    RankResult,
    RankTimeoutError,
    rank_layout,
)

if TYPE_CHECKING:
    from typing import Self

OUTPUT_TAIL = 3000
PORT_BASE = 29600  # inside a fresh namespace every port is free; one per run keeps TIME_WAIT out of the way


@dataclass
class RankOutcome:
    ok: bool
    reason: str = ""
    seconds: float = 0.0


@dataclass
class CellFiles:
    steps: list[dict] = field(default_factory=list)
    baselines: dict[str, list[float]] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)
    compute_probe: dict | None = None


def _package_env(threads: int) -> dict[str, str]:
    root = str(Path(scalerl.__file__).resolve().parents[1])  # ranks import this very scalerl
    path = os.environ.get("PYTHONPATH", "")
    # PYTHONFAULTHANDLER: a rank killed by a fatal signal prints every thread's Python stack into its output
    return {"PYTHONPATH": root + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": str(threads),
            "PYTHONFAULTHANDLER": "1"}


class Launcher:
    """Runs rank programs; holds the emulated clusters until closed."""

    def __init__(self, log: Any = None):
        self._stack = ExitStack()
        self._clusters: dict[tuple[int, float], EmulatedCluster] = {}
        self._runs = 0
        self.log = log or (lambda message: None)

    def close(self) -> None:
        self._stack.close()
        self._clusters.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cluster(self, nodes: int, rate_mbit: float) -> EmulatedCluster:
        key = (nodes, rate_mbit)
        if key not in self._clusters:
            self.log(f"building an emulated cluster: {nodes} nodes, links shaped at {rate_mbit:g} Mbit/s")
            self._clusters[key] = self._stack.enter_context(EmulatedCluster(nodes=nodes, rate_mbit=rate_mbit))
        return self._clusters[key]

    def run(self, module: str, spec: dict[str, Any], nodes: int, ranks_per_node: int, rate_mbit: float,
            timeout_s: float, threads: int = 1) -> RankOutcome:
        """``python -m module SPEC.json`` on nodes x ranks_per_node ranks; waits at most ``timeout_s``."""
        spec_path = Path(spec["out_dir"]) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", module, str(spec_path)]
        env = _package_env(threads)
        self._runs += 1
        start = time.perf_counter()
        try:
            if nodes == 1:
                results = self._run_local(argv, ranks_per_node, env, timeout_s, Path(spec["out_dir"]))
            else:
                cluster = self.cluster(nodes, rate_mbit)
                cluster.master_port = PORT_BASE + self._runs % 200
                results = cluster.run_ranks(argv, ranks_per_node, env=env, timeout_s=timeout_s)
        except RankTimeoutError as e:
            return RankOutcome(False, f"timed out after {timeout_s:g} s: {str(e)[-OUTPUT_TAIL:]}",
                               time.perf_counter() - start)
        failed = [r for r in results if r.returncode != 0 and not r.killed] or \
                 [r for r in results if r.returncode != 0]
        if failed:
            return RankOutcome(False, _describe_failure(failed[0]), time.perf_counter() - start)
        return RankOutcome(True, "", time.perf_counter() - start)

    @staticmethod
    def _run_local(argv: list[str], ranks: int, env: dict[str, str], timeout_s: float,
                   log_dir: Path) -> list[RankResult]:
        port = free_port()
        specs = []
        for rank, _, local_rank in rank_layout(1, ranks, "grouped"):
            rank_env = {**os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(ranks),
                        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0",
                        "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
            specs.append((rank, 0, argv, rank_env))
        logs = log_dir / "logs"
        logs.mkdir(exist_ok=True)
        return RankGroup.start(specs, str(logs)).wait(timeout_s)


def _describe_failure(result: RankResult) -> str:
    output = (result.output or "").strip()
    lines = [line for line in output.splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if line.startswith(("error:", "RuntimeError", "ValueError",
                                                                       "torch.", "scalerl."))), "")
    return f"rank {result.rank} {result.describe()}" + (f": {error}" if error else "") + \
        (f"\n--- output (tail) ---\n{output[-OUTPUT_TAIL:]}" if output else "")


def read_cell_files(out_dir: Path) -> CellFiles:
    files = CellFiles()
    steps_path = out_dir / "steps.json"
    if steps_path.exists():
        data = json.loads(steps_path.read_text())
        files.steps, files.baselines, files.model = data["steps"], data.get("baselines", {}), data.get("model", {})
        files.compute_probe = data.get("compute_probe")
    files.ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    files.ranks.sort(key=lambda r: r["rank"])
    return files


def probe_links(launcher: Launcher, nodes: int, ranks_per_node: int, rate_mbit: float, work_dir: Path,
                timeout_s: float = 300) -> dict[str, Any]:
    """Alpha-beta of the inter-node link (2+ nodes) and of a node's loopback (2+ ranks per node), fitted to
    all-reduce sweeps run here; ``{"inter": {...}, "intra": {...}}`` with the points and the fit's error."""
    out_dir = Path(tempfile.mkdtemp(prefix="probe-", dir=work_dir))
    per_node = max(2, ranks_per_node) if nodes == 1 else ranks_per_node
    outcome = launcher.run("scalerl.bench.link_probe", {"out_dir": str(out_dir), "ranks_per_node": per_node},
                           nodes, per_node, rate_mbit, timeout_s)
    if not outcome.ok:
        return {"error": outcome.reason}
    data = json.loads((out_dir / "probe.json").read_text())
    shutil.rmtree(out_dir, ignore_errors=True)
    fitted: dict[str, Any] = {}
    for scope in ("inter", "intra"):
        if scope not in data:
            continue
        p = data[scope]["p"]
        sizes = [r["size"] for r in data[scope]["results"]]
        seconds = [r["time_s"] for r in data[scope]["results"]]
        where = f"{rate_mbit:g} Mbit/s emulated link" if scope == "inter" else "loopback of one node"
        link = fit_link(sizes, seconds, "all_reduce", p, source=f"measured: all-reduce sweep over the {where}, "
                                                                 f"{p} ranks, {len(sizes)} sizes")
        fitted[scope] = {**link.to_dict(), "p": p, "sizes": sizes, "seconds": seconds,
                         "fit_max_error": fit_error(link, sizes, seconds, "all_reduce", p),
                         "rate_mbit": rate_mbit if scope == "inter" else None}
    return fitted
