"""What tests on the emulated network share (ranks in network namespaces joined by tc-shaped links,
`scalerl.launch.emulated_cluster`): whether it can be built on this machine, and waiting for its ranks,
which run as separate processes and say how far they got through marker files."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from scalerl.launch.emulated_cluster import (
    EmulatedCluster,
    EmulatedClusterError,
    require_root_and_iproute2,
)


def emulated_network_unavailable() -> str | None:
    """Why a two-node emulated network cannot be built here (None: it can). Builds one and takes it down:
    root and iproute2 alone do not prove it (a container may lack the rights to create namespaces)."""
    try:
        require_root_and_iproute2()
        with EmulatedCluster(nodes=2, rate_mbit=0):
            pass
    except EmulatedClusterError as exc:
        return str(exc)
    return None


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail the test, naming ``what``, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


def rank_reports(results: list[Any]) -> list[dict[str, Any]]:
    """Each rank's ``REPORT {json}`` line (rank scripts print one when done), in the order of ``results``;
    every rank must have exited 0 (else the ranks' output tails are the assertion's message)."""
    assert [r.returncode for r in results] == [0] * len(results), [r.output[-3000:] for r in results]
    return [json.loads(next(line for line in r.output.splitlines() if line.startswith("REPORT "))[7:])
            for r in results]
