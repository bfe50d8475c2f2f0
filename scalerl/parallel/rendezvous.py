"""Joining the process group within a limit: the TCP store every rank meets at (MASTER_ADDR:MASTER_PORT).

torch's `env://` rendezvous waits as long as the collective timeout (30 minutes by default) for an
unreachable master, and reports it with C++ stack dumps. Here rank 0 binds the store itself (a busy port is
an error naming MASTER_PORT at once) and waits `rendezvous_timeout_s` for every rank to join; the others
first wait, in Python, for the master's port to accept connections, so an unreachable master ends in one
message naming the address, the world size and the limit. Under torchrun its agent hosts the store, as
torch's own `env://` assumes (`TORCHELASTIC_USE_AGENT_STORE`), and rank 0 joins it like the others.

Every store is made by `connect_store`, which gives `TCPStore`'s constructor a hard deadline: its own
timeout once did not end a handshake that hung inside it (three ranks of a test stuck 20 minutes), so it
runs in a daemon thread, and a rank still waiting `STORE_GRACE_S` after the limit gives up. The doctor's
rendezvous (`scalerl.doctor.world`) makes its store here too.

A rank still waiting after its first attempt says so on stderr at once (what it waits for: the address, its
rank, the world size, and for how long), then every `PROGRESS_EVERY_S` (how long it has waited, how long is
left), so a job whose master never comes up is not silent for the whole limit before its error.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from scalerl.core.errors import RunFailure
from scalerl.core.net import free_port
from scalerl.core.rank_env import RankEnvError

_CONNECT_RETRY_S = 0.5
STORE_GRACE_S = 5.0  # past the store's own timeout, before a constructor that has not returned is abandoned
PROGRESS_EVERY_S = 15.0  # how often a rank still waiting to join says so


class WaitReport:
    """What a waiting rank says on stderr: at its first `tick` who waits for what and for how long at most,
    then at most every `every_s` how long it has waited and how long is left (`detail`: the last error)."""

    def __init__(self, who: str, what: str, timeout_s: float, every_s: float = PROGRESS_EVERY_S):
        self.who, self.what, self.timeout_s, self.every_s = who, what, timeout_s, every_s
        self.started = time.monotonic()
        self.next_at: float | None = None  # when the next line is due; None before the first

    def tick(self, detail: str = "") -> None:
        now = time.monotonic()
        if self.next_at is None:
            line = (f"rendezvous: {self.who} is waiting for {self.what}, for up to "
                    f"trainer.rendezvous_timeout_s={self.timeout_s:g} s")
        elif self.next_at <= now < self.started + self.timeout_s:  # past the limit, the error says the rest
            waited = now - self.started
            line = (f"rendezvous: {self.who} still waiting for {self.what}: {round(waited, 1):g} s so far, "
                    f"{round(self.timeout_s - waited, 1):g} s left" + (f" (last: {detail})" if detail else ""))
        else:
            return
        print(line, file=sys.stderr, flush=True)
        self.next_at = now + self.every_s


class RendezvousError(RunFailure):
    """The process group could not be formed within the rendezvous limit; the message says who waited for what."""


class StoreDeadlineError(RendezvousError):
    """`TCPStore`'s constructor did not return within its timeout plus `STORE_GRACE_S`."""


def connect_store(host: str, port: int, *, is_master: bool, timeout_s: float, world_size: int | None = None,
                  wait_for_workers: bool = False, waiting: Callable[[], None] | None = None) -> dist.TCPStore:
    """``dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers)`` with a hard deadline:
    the constructor runs in a daemon thread, its errors are raised here as they are, and one still running
    `timeout_s` + `STORE_GRACE_S` later is left behind with a `StoreDeadlineError`. `waiting` is called
    every `_CONNECT_RETRY_S` while the constructor runs (a `WaitReport.tick`)."""
    result: dict[str, object] = {}

    def construct() -> None:
        try:
            result["store"] = dist.TCPStore(host, port, world_size, is_master, timeout=timedelta(seconds=timeout_s),
                                            wait_for_workers=wait_for_workers)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
            result["error"] = e

    thread = threading.Thread(target=construct, name=f"tcpstore-{host}:{port}", daemon=True)
    thread.start()
    end = time.monotonic() + timeout_s + STORE_GRACE_S
    step_s = _CONNECT_RETRY_S if waiting is not None else timeout_s + STORE_GRACE_S
    while thread.is_alive() and time.monotonic() < end:
        thread.join(max(0.0, min(step_s, end - time.monotonic())))
        if waiting is not None and thread.is_alive():
            waiting()
    if "error" in result:
        raise result["error"]
    if "store" not in result:
        role = "hosting" if is_master else "joining"
        raise StoreDeadlineError(f"{role} the TCP store at {host}:{port} had not returned after {timeout_s:g} s + "
                                 f"{STORE_GRACE_S:g} s (the store's own timeout did not end it)")
    return result["store"]


def rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float,
                     progress_every_s: float = PROGRESS_EVERY_S) -> dist.TCPStore:
    """The TCP store of the job: hosted by rank 0, joined by every other rank, all within `timeout_s`; a
    rank still waiting says so on stderr at once and then every `progress_every_s` (`WaitReport`)."""
    where = f"MASTER_ADDR:MASTER_PORT = {master_addr}:{master_port}"
    limit = f"within trainer.rendezvous_timeout_s={timeout_s:g} s"
    # Under torchrun the agent already hosts the store at MASTER_PORT: every rank, 0 too, is a client there.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and not agent_hosts_store:
        report = WaitReport(f"rank 0 of {world_size}", f"{world_size - 1} more rank(s) to join the rendezvous it hosts "
                            f"at {master_addr}:{master_port}", timeout_s, progress_every_s)
        try:
            return connect_store(master_addr, master_port, is_master=True, timeout_s=timeout_s,
                                 world_size=world_size, wait_for_workers=True, waiting=report.tick)
        except StoreDeadlineError as e:
            raise RendezvousError(f"rank 0 could not host the rendezvous at {where} {limit}: {e}") from None
        except dist.DistNetworkError as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e):
                raise RankEnvError(f"MASTER_PORT={master_port} is already in use on this host (rank 0 hosts the "
                                   "rendezvous there): choose a free port, e.g. MASTER_PORT="
                                   f"{free_port()}, and give it to every rank") from None
            raise RendezvousError(f"rank 0 cannot host the rendezvous at {where}: {e}") from None
        except dist.DistStoreError as e:  # "Timed out ... waiting for clients. 1/2 clients joined."
            raise RendezvousError(f"rank 0 waited for the {world_size} ranks of the job to join at {where}, but "
                                  f"not all came {limit} ({e}); start every rank with WORLD_SIZE={world_size} and "
                                  "the same MASTER_ADDR/MASTER_PORT") from None
    deadline = time.monotonic() + timeout_s
    report = WaitReport(f"rank {rank} of {world_size}", f"the rendezvous at {master_addr}:{master_port} (rank 0 "
                        "hosts it)", timeout_s, progress_every_s)
    last_error = _wait_for_port(master_addr, master_port, deadline, report)
    if last_error is not None:
        raise RendezvousError(f"rank {rank} of {world_size} could not reach the rendezvous at {where} {limit} "
                              f"({last_error}): is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?")
    try:
        # wait_for_workers=True on a client too: that is where it adds itself to the count rank 0 waits for
        # (TCPStore::waitForWorkers); without it rank 0 waits out its whole limit for a rank already here.
        return connect_store(master_addr, master_port, is_master=False, world_size=world_size,
                             timeout_s=max(1.0, deadline - time.monotonic()), wait_for_workers=True,
                             waiting=report.tick)
    except (dist.DistError, StoreDeadlineError) as e:
        raise RendezvousError(f"rank {rank} of {world_size} reached {where} but could not join the rendezvous "
                              f"{limit}: {e}") from None


def _wait_for_port(host: str, port: int, deadline: float, report: WaitReport) -> str | None:
    """None once `host:port` accepts a TCP connection before `deadline`, else the last error seen; every
    failed attempt ticks `report` (so the first one says what this rank waits for)."""
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return last
        try:
            with socket.create_connection((host, port), timeout=min(5.0, remaining)):
                return None
        except OSError as e:  # refused (nobody listens yet), unreachable, unknown host, timed out
            last = e.strerror or str(e) or type(e).__name__
        report.tick(last)
        time.sleep(min(_CONNECT_RETRY_S, max(0.0, deadline - time.monotonic())))
