"""Which ranks are still alive, for the message a failed collective ends with.

A collective that times out or loses its connection says neither which peer stopped nor why. Every rank
therefore counts a heartbeat in the job's TCP store (`scalerl/alive/<rank>`, from a daemon thread every
`interval_s`, on its own store connection). After a failure, `silent_ranks` reads all counters twice,
a few intervals apart: a rank whose counter did not move is frozen (SIGSTOP, a hung host) or gone. The
thread stops with the process, so a stopped process stops counting too.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 2.0
_KEY = "scalerl/alive/{rank}"


@dataclass(frozen=True)
class LivenessReport:
    """`silent`: ranks whose heartbeat stopped; `store_reachable`: False when rank 0's store did not answer
    (then rank 0 itself is frozen or gone and the other ranks cannot be told apart)."""

    silent: list[int]
    store_reachable: bool


class RankHeartbeat:
    """This rank's heartbeat thread; `stop()` ends it (also ends by itself when the store goes away)."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int,
                 interval_s: float = HEARTBEAT_INTERVAL_S):
        self.master_addr, self.master_port = master_addr, master_port
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._stop = threading.Event()
        self._store = dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                                    timeout=timedelta(seconds=30))
        self._store.add(_KEY.format(rank=rank), 1)
        self._thread = threading.Thread(target=self._beat, name=f"scalerl-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(_KEY.format(rank=self.rank), 1)
            except Exception:  # the store (rank 0) is gone: the job is ending, nothing left to report to
                return

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self, observe_s: float | None = None) -> LivenessReport:
        """Ranks whose counter did not move over `observe_s` (default 2.5 intervals), this rank excluded.
        Takes at most `observe_s` + 10 s: the store is read from a helper thread that is abandoned if rank 0
        does not answer (a frozen process's socket accepts connections in the kernel, then never replies,
        and a store client then waits regardless of its timeout)."""
        observe_s = 2.5 * self.interval_s if observe_s is None else observe_s
        if not _accepts_connections(self.master_addr, self.master_port):
            return LivenessReport([], store_reachable=False)
        counts: list[list[int]] = []

        def read_twice() -> None:
            reader = dist.TCPStore(self.master_addr, self.master_port, self.world_size, is_master=False,
                                   timeout=timedelta(seconds=max(5.0, observe_s)))
            counts.append([reader.add(_KEY.format(rank=r), 0) for r in range(self.world_size)])
            time.sleep(observe_s)
            counts.append([reader.add(_KEY.format(rank=r), 0) for r in range(self.world_size)])

        reader = threading.Thread(target=_quietly, args=(read_twice,), name="scalerl-liveness-probe", daemon=True)
        reader.start()
        reader.join(observe_s + 10.0)
        if len(counts) < 2:
            return LivenessReport([], store_reachable=False)
        before, after = counts
        silent = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
        return LivenessReport(silent, store_reachable=True)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # the caller reads an unreachable store from the missing result
        pass


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False
