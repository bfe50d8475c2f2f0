"""Joining the process group within `trainer.rendezvous_timeout_s`: a missing rank, an unreachable master,
a busy MASTER_PORT and a store constructor that never returns each end in one error naming the address, the
world size and the limit, and a rank waiting for them says so on stderr meanwhile. In-process: no group is
formed in any of these cases."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest
import torch.distributed as dist

from scalerl.core.net import free_port
from scalerl.core.rank_env import RankEnvError
from scalerl.parallel import rendezvous
from scalerl.parallel.process_group import enable_nccl_flight_recorder
from scalerl.parallel.rendezvous import (
    RendezvousError,
    StoreDeadlineError,
    connect_store,
    rendezvous_store,
)


def test_rank_zero_waits_only_the_limit_for_missing_ranks():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as raised:
        rendezvous_store("127.0.0.1", port, rank=0, world_size=3, timeout_s=1.0)
    assert time.monotonic() - start < 10
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message and "3 ranks" in message and "1/3" in message
    assert "trainer.rendezvous_timeout_s=1" in message


def test_ranks_that_come_are_counted_and_the_store_forms_at_once():
    """Rank 0 returns as soon as every rank has joined (each client adds itself to the count rank 0 waits
    for), not after its limit: a client that did not count itself left rank 0 waiting the whole 120 s."""
    port, world = free_port(), 3
    stores, errors = {}, []

    def join(rank: int) -> None:
        try:
            stores[rank] = rendezvous_store("127.0.0.1", port, rank=rank, world_size=world, timeout_s=20.0)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    start = time.monotonic()
    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and sorted(stores) == [0, 1, 2]
    assert time.monotonic() - start < 10, "rank 0 waited for ranks that had already joined"
    stores[1].set("from-1", "x")
    assert stores[2].get("from-1") == b"x"


def test_unreachable_master_is_named_after_the_limit():
    port = free_port()  # nobody listens there
    start = time.monotonic()
    expected = f"rank 2 of 4 could not reach .*127.0.0.1:{port} .*rendezvous_timeout_s=0.5 s"
    with pytest.raises(RendezvousError, match=expected):
        rendezvous_store("127.0.0.1", port, rank=2, world_size=4, timeout_s=0.5)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("rank, waits_for", [
    (1, "the rendezvous at 127.0.0.1:{port} (rank 0 hosts it)"),
    (0, "1 more rank(s) to join the rendezvous it hosts at 127.0.0.1:{port}"),
])
def test_a_waiting_rank_says_at_once_what_it_waits_for_then_how_long(capsys, rank, waits_for):
    """Not silent for the whole limit (120 s by default): the first line comes at the first failed attempt,
    the next ones every `progress_every_s` with the time waited and left, none past the limit."""
    port = free_port()  # nobody serves it (rank 1), nobody joins it (rank 0)
    waits_for = waits_for.format(port=port)
    outcome = {}

    def attempt() -> None:
        try:
            rendezvous_store("127.0.0.1", port, rank=rank, world_size=2, timeout_s=1.6, progress_every_s=0.2)
        except RendezvousError as e:
            outcome["error"] = e

    waiting = threading.Thread(target=attempt, daemon=True)
    waiting.start()
    time.sleep(0.8)  # the first line is due at the first failed attempt (rank 1) or join slice (rank 0): 0.5 s
    early = capsys.readouterr().err
    waiting.join(10)
    assert "error" in outcome and f"127.0.0.1:{port}" in str(outcome["error"])
    assert early.splitlines()[0] == (f"rendezvous: rank {rank} of 2 is waiting for {waits_for}, for up to "
                                     "trainer.rendezvous_timeout_s=1.6 s")
    later = (early + capsys.readouterr().err).splitlines()[1:]
    assert len(later) >= 2, later
    for line in later:
        assert line.startswith(f"rendezvous: rank {rank} of 2 still waiting for {waits_for}: "), line
        waited, left = map(float, re.search(r": ([\d.]+) s so far, ([\d.]+) s left", line).groups())
        assert 0 < waited < 1.6 and left == pytest.approx(1.6 - waited, abs=0.1)


def test_busy_master_port_names_the_variable():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RankEnvError, match=f"MASTER_PORT={port} is already in use"):
            rendezvous_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=5.0)


@pytest.fixture
def hanging_store(monkeypatch):
    """`dist.TCPStore` replaced by a constructor that blocks until the test ends (as one once did for 20
    minutes despite its timeout); the grace past the timeout shortened to keep the test quick."""
    release, calls = threading.Event(), []

    def never_returns(*args, **kwargs):
        calls.append((args, kwargs))
        release.wait(120)  # set at teardown; bounded all the same
        raise RuntimeError("released at teardown")

    monkeypatch.setattr(dist, "TCPStore", never_returns)
    monkeypatch.setattr(rendezvous, "STORE_GRACE_S", 0.5)
    yield calls
    release.set()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_store_constructor_that_never_returns_ends_at_the_deadline(hanging_store, rank):
    with socket.socket() as master:  # rank 1 first waits for the master's port to accept connections
        master.bind(("127.0.0.1", 0))
        master.listen()
        port = master.getsockname()[1]
        outcome = {}

        def attempt() -> None:  # in a thread of its own, so that a rendezvous without a deadline fails here
            start = time.monotonic()
            try:
                rendezvous_store("127.0.0.1", port, rank=rank, world_size=2, timeout_s=1.0)
            except BaseException as e:  # noqa: BLE001
                outcome["error"], outcome["elapsed"] = e, time.monotonic() - start

        waiting = threading.Thread(target=attempt, daemon=True)
        waiting.start()
        waiting.join(10)
    assert "error" in outcome, "rendezvous_store was still inside the store's constructor after 10 s"
    error = outcome["error"]
    assert isinstance(error, RendezvousError), error
    assert 1.0 + 0.5 <= outcome["elapsed"] < 1.0 + 0.5 + 3  # the limit plus the grace, not the constructor's hang
    assert f"rank {rank} " in str(error) and f"127.0.0.1:{port}" in str(error)
    assert "had not returned after" in str(error) and "rendezvous_timeout_s=1 s" in str(error)
    assert hanging_store[0][1]["timeout"].total_seconds() <= 1.0  # the store got the limit as its own timeout


def test_connect_store_raises_the_constructors_own_error(monkeypatch):
    def refuses(*args, **kwargs):
        raise dist.DistNetworkError("connection refused")

    monkeypatch.setattr(dist, "TCPStore", refuses)
    start = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="connection refused"):
        connect_store("127.0.0.1", 1, is_master=False, timeout_s=30)
    assert time.monotonic() - start < 5  # at once, not after the deadline


def test_connect_store_returns_a_working_store():
    store = connect_store("127.0.0.1", free_port(), is_master=True, timeout_s=10, world_size=1)
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert issubclass(StoreDeadlineError, RendezvousError)


def test_nccl_flight_recorder_defaults_keep_the_users_settings(tmp_path):
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    enable_nccl_flight_recorder(tmp_path / "traces", env)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "traces" / "nccl_trace_rank_")}
    assert (tmp_path / "traces").is_dir()
