"""Rank processes of an emulated cluster: where each rank sits, starting them, waiting with a deadline.

Stdlib only, like `emulated_cluster`. Each rank runs in its own session so that killing it takes its
children too; when one rank fails the others are killed at once (they would only hang in their next
collective), as torchrun does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 5.0
POLL_S = 0.05
OUTPUT_TAIL_CHARS = 2000


class RankTimeoutError(RuntimeError):
    """Some ranks did not finish before the deadline; the message names them and shows their output."""


def rank_layout(nodes: int, ranks_per_node: int, placement: str) -> list[tuple[int, int, int]]:
    """(rank, node, local rank) for every rank. "grouped": node k holds ranks k*rpn .. k*rpn+rpn-1;
    "interleaved": rank r sits on node r % nodes (what a launcher with the wrong order does)."""
    if placement not in ("grouped", "interleaved"):
        raise ValueError(f"placement must be 'grouped' or 'interleaved', got {placement!r}")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    layout = []
    for rank in range(nodes * ranks_per_node):
        if placement == "grouped":
            layout.append((rank, rank // ranks_per_node, rank % ranks_per_node))
        else:
            layout.append((rank, rank % nodes, rank // nodes))
    return layout


@dataclass(frozen=True)
class RankResult:
    rank: int
    node: int
    returncode: int  # negative: killed by that signal
    output: str | None  # stdout and stderr together; None when not captured
    killed: bool = False  # we killed it: another rank failed, or the deadline passed

    def describe(self) -> str:
        if self.returncode >= 0:
            how = f"exited with {self.returncode}"
        else:
            how = f"ended by {signal.Signals(-self.returncode).name}"
        return how + (" (killed after another rank failed or the deadline passed)" if self.killed else "")

    @property
    def exit_status(self) -> int:
        """As a shell reports it: 128 + signal for a killed process."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode


@dataclass
class _RankProcess:
    rank: int
    node: int
    popen: subprocess.Popen
    log_path: Path | None
    killed: bool = False


class RankGroup:
    def __init__(self, procs: list[_RankProcess]):
        self.procs = procs

    @classmethod
    def start(cls, specs: list[tuple[int, int, list[str], dict[str, str]]], log_dir: str | None) -> RankGroup:
        """specs: (rank, node, argv, env). Output goes to log_dir/rank<R>.log, or to ours when log_dir is None."""
        group = cls([])
        try:
            for rank, node, argv, env in specs:
                log_path = Path(log_dir) / f"rank{rank}.log" if log_dir else None
                out = open(log_path, "wb") if log_path else None
                try:
                    popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT if out else None, start_new_session=True)
                finally:
                    if out:
                        out.close()  # the child holds its own copy
                group.procs.append(_RankProcess(rank, node, popen, log_path))
        except BaseException:
            group.kill()
            raise
        return group

    def wait(self, timeout_s: float) -> list[RankResult]:
        """Wait for every rank; if one fails, kill the rest. After timeout_s, kill all and raise
        RankTimeoutError naming the ranks that had not finished."""
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.popen.poll() for p in self.procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                stuck = [p for p, c in zip(self.procs, codes) if c is None]
                self.kill()
                raise RankTimeoutError(
                    f"rank(s) {', '.join(f'{p.rank} (node {p.node})' for p in stuck)} did not finish within "
                    f"{timeout_s:g} s; all ranks killed" + "".join(self._tail(p) for p in stuck))
            time.sleep(POLL_S)
        self.kill()  # the survivors of a failure
        return [RankResult(p.rank, p.node, p.popen.returncode, self._output(p), p.killed) for p in self.procs]

    def kill(self) -> None:
        """SIGTERM each running rank's process group, SIGKILL what is left after KILL_GRACE_S."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            running = [p for p in self.procs if p.popen.poll() is None]
            for p in running:
                p.killed = True
                try:
                    os.killpg(p.popen.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + KILL_GRACE_S
            while any(p.popen.poll() is None for p in running) and time.monotonic() < deadline:
                time.sleep(POLL_S)
        alive = [p.rank for p in self.procs if p.popen.poll() is None]
        if alive:
            print(f"warning: rank(s) {alive} still alive {KILL_GRACE_S:g} s after SIGKILL", file=sys.stderr)

    @staticmethod
    def _output(p: _RankProcess) -> str | None:
        return p.log_path.read_text(errors="replace") if p.log_path and p.log_path.exists() else None

    def _tail(self, p: _RankProcess) -> str:
        output = self._output(p)
        return f"\n--- rank {p.rank} output (tail) ---\n{output[-OUTPUT_TAIL_CHARS:]}" if output else ""
