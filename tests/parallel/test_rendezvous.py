"""Joining the process group within `trainer.rendezvous_timeout_s`: a missing rank, an unreachable master and
a busy MASTER_PORT each end in one error naming the address, the world size and the limit. In-process: no
group is formed in any of these cases."""

from __future__ import annotations

import socket
import time

import pytest

from scalerl.core.net import free_port
from scalerl.core.rank_env import RankEnvError
from scalerl.parallel.process_group import enable_nccl_flight_recorder
from scalerl.parallel.rendezvous import RendezvousError, rendezvous_store


def test_rank_zero_waits_only_the_limit_for_missing_ranks():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as raised:
        rendezvous_store("127.0.0.1", port, rank=0, world_size=3, timeout_s=1.0)
    assert time.monotonic() - start < 10
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message and "3 ranks" in message and "1/3" in message
    assert "trainer.rendezvous_timeout_s=1" in message


def test_unreachable_master_is_named_after_the_limit():
    port = free_port()  # nobody listens there
    start = time.monotonic()
    expected = f"rank 2 of 4 could not reach .*127.0.0.1:{port} .*rendezvous_timeout_s=0.5 s"
    with pytest.raises(RendezvousError, match=expected):
        rendezvous_store("127.0.0.1", port, rank=2, world_size=4, timeout_s=0.5)
    assert time.monotonic() - start < 5


def test_busy_master_port_names_the_variable():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RankEnvError, match=f"MASTER_PORT={port} is already in use"):
            rendezvous_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=5.0)


def test_nccl_flight_recorder_defaults_keep_the_users_settings(tmp_path):
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    enable_nccl_flight_recorder(tmp_path / "traces", env)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "traces" / "nccl_trace_rank_")}
    assert (tmp_path / "traces").is_dir()
