"""init_distributed's checks before the process group starts: a *_SOCKET_IFNAME naming an interface this
node lacks fails at once, naming the variable, the interface and the node (instead of hanging in the
rendezvous)."""

import re
import socket

import pytest
import torch
import torch.distributed as dist

from scalerl.comm.net.socket_interface import SocketInterfaceError
from scalerl.core.config import ParallelSection
from scalerl.core.net import free_port
from scalerl.parallel.distributed import init_distributed


def test_missing_socket_interface_fails_before_the_rendezvous(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "GLOO_SOCKET_IFNAME": "srlnosuch0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SocketInterfaceError, match=rf"GLOO_SOCKET_IFNAME=srlnosuch0: interface srlnosuch0 does not "
                                                   rf"exist on node {re.escape(socket.gethostname())} \(rank 0\)"):
        init_distributed(ParallelSection(dp_replicate=2), torch.device("cpu"))
    assert not dist.is_initialized()


def _gather_with_warnings(rank: int):
    import warnings

    from scalerl.parallel.distributed import single_process_context

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = single_process_context().all_gather(torch.tensor([float(rank)]), over=dist.group.WORLD)
    return gathered.tolist(), [str(w.message) for w in caught]


def test_the_tensor_all_gather_warns_no_rank_of_a_deprecated_name():
    from tests.spawned_group import run_in_group

    for gathered, warned in run_in_group(_gather_with_warnings, 2, timeout_s=120):
        assert gathered == [0.0, 1.0]
        assert not [w for w in warned if "deprecated" in w]  # torch 2.13's all_gather_into_tensor warned each rank
