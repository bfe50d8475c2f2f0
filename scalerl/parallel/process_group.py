"""Forming this process's torch.distributed group within limits, and describing it when a collective fails.

`join_process_group` replaces `init_process_group(init_method="env://")`: the rendezvous is bounded by its own
limit (`rendezvous.rendezvous_store`), every collective by the collective limit, and each rank starts a
heartbeat (`rank_liveness`). `describe_failure` turns a failed collective into a sentence naming the
collective, its group, the call site and the ranks that went silent (`collective_failures`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from scalerl.core.rank_env import launcher_restart_count
from scalerl.parallel.collective_failures import (
    describe_collective_failure,
    is_collective_failure,
)
from scalerl.parallel.rank_liveness import RankHeartbeat
from scalerl.parallel.rendezvous import RendezvousError, rendezvous_store

# The group this process formed (like torch's own default group, one per process): its collective limit and
# heartbeat, which `describe_failure` reports on.
_JOINED: dict = {"timeout_s": None, "heartbeat": None}


def join_process_group(rank: int, world_size: int, device: torch.device, dist_timeout_s: float,
                       rendezvous_timeout_s: float, trace_dir: str | Path | None = None) -> None:
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT within `rendezvous_timeout_s` (a `RendezvousError`
    names the address and the world size otherwise) and form the default group, whose collectives then wait
    at most `dist_timeout_s`. On NCCL, `trace_dir` receives torch's flight-recorder dump of a timed-out
    collective (NCCL's watchdog ends the process itself, so no Python error reports it)."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    store = rendezvous_store(addr, port, rank, world_size, rendezvous_timeout_s)
    group_store: dist.Store = store
    restarts = launcher_restart_count()
    if restarts:
        # A launcher restart (torchrun's static rendezvous) may hand back the same store, still holding the
        # previous attempt's gloo/NCCL addresses: a restarted rank could read its peer's dead address before the
        # peer overwrites it ("connection refused" in connectFullMesh: 4 of 6 restarts tried failed so, none of
        # 5 with a prefix per attempt).
        group_store = dist.PrefixStore(f"scalerl/restart_{restarts}", store)
    options = {}
    if device.type == "cuda":
        enable_nccl_flight_recorder(trace_dir)
        options["device_id"] = torch.device("cuda", torch.cuda.current_device())  # NCCL joins now, not later
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=group_store, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=dist_timeout_s), **options)
    except (dist.DistError, RuntimeError) as e:
        raise RendezvousError(f"rank {rank} of {world_size} met the others at {addr}:{port} but could not form "
                              f"the process group within trainer.rendezvous_timeout_s={rendezvous_timeout_s:g} s: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    store.set_timeout(timedelta(seconds=dist_timeout_s))  # joined: later store waits are collectives
    _JOINED.update(timeout_s=dist_timeout_s, heartbeat=RankHeartbeat(addr, port, rank, world_size))


def describe_failure(error: BaseException) -> str | None:
    """The collective, group and silent ranks behind `error`; None when it is not a collective failure (or
    no process group exists)."""
    if not dist.is_initialized() or not is_collective_failure(error):
        return None
    return describe_collective_failure(error, dist.get_rank(), dist.get_world_size(), _JOINED["timeout_s"],
                                       _JOINED["heartbeat"])


def stop_heartbeat() -> None:
    """End this rank's heartbeat once its run is over (the process may live on, e.g. as a Ray actor)."""
    if _JOINED["heartbeat"] is not None:
        _JOINED["heartbeat"].stop()
        _JOINED["heartbeat"] = None


def enable_nccl_flight_recorder(trace_dir: str | Path | None, environ=None) -> None:
    """Turn on torch's NCCL flight recorder (the last collectives of each rank, dumped when one times out)
    unless the user configured it; dumps go to `trace_dir/nccl_trace_rank_<rank>` (torch's default: /tmp)."""
    environ = os.environ if environ is None else environ
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if trace_dir is not None and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in environ:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(trace_dir) / "nccl_trace_rank_")
