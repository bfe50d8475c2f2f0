"""The process group and mesh a run uses, and the few collectives the trainer needs on the DP dimension.

A single process gets the same object with sizes of 1 and no-op collectives, so the trainer has one code
path for every layout. Nothing waits without a limit: joining the group is bounded by the rendezvous limit
(`scalerl.parallel.rendezvous`), every collective by the collective limit, and a failed collective is
described by name, group and the ranks that went silent (`describe_failure`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from scalerl.core.rank_env import RankEnvError, apply_rank_env, detect_rank_env
from scalerl.parallel.collective_failures import describe_collective_failure, is_collective_failure
from scalerl.parallel.mesh import ParallelDims
from scalerl.parallel.rank_liveness import RankHeartbeat
from scalerl.parallel.rendezvous import RendezvousError, rendezvous_store


@dataclass
class DistContext:
    dims: ParallelDims
    mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None = None
    rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None and self.dims.dp > 1 else 0

    @property
    def dp_group(self):
        return self.dp_mesh.get_group() if self.dp_mesh is not None and self.dims.dp > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``dp_shard`` alone, or ``(dp_replicate, dp_shard)`` for HSDP."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else self.mesh["dp_shard"]

    def dp_share(self, rows: list) -> list:
        """This DP rank's contiguous share of ``rows`` (TP/PP peers get the same share). A remainder that
        does not split evenly is dropped: every rank must run the same number of generation calls."""
        if self.dp_size == 1:
            return rows
        per_rank = len(rows) // self.dp_size
        return rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place reduction over the data-parallel ranks (TP/PP peers hold the same values already)."""
        if self.dims.dp > 1:
            dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor

    def all_finished(self, flag: bool) -> bool:
        """True once every DP rank is done: ranks whose forwards hold collectives (FSDP all-gathers, TP
        all-reduces) must run the same number of decode steps."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()



def single_process_context() -> DistContext:
    return DistContext(ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1), mesh=None)


def init_distributed(parallel_cfg, device: torch.device, dist_timeout_s: float = 600.0,
                     rendezvous_timeout_s: float = 120.0, trace_dir: str | Path | None = None) -> DistContext:
    """Join the process group described by the launcher's environment (torchrun, Slurm, MPI, Ray all end
    with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) and build the named mesh.

    Joining waits at most `rendezvous_timeout_s` (an unreachable master or a missing rank is a
    `RendezvousError` naming MASTER_ADDR:MASTER_PORT and the world size); each collective then waits at most
    `dist_timeout_s`. On NCCL, `trace_dir` receives torch's flight-recorder dump of a timed-out collective
    (NCCL's watchdog ends the process itself, so no Python error reports it)."""
    env = detect_rank_env()
    if env is not None:
        apply_rank_env(env)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        ParallelDims.from_config(parallel_cfg, 1)  # a layout asking for more ranks fails here, by name
        return single_process_context()
    dims = ParallelDims.from_config(parallel_cfg, world_size)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # WORLD_SIZE alone, e.g. left over in a shell
            raise RankEnvError(f"WORLD_SIZE={world_size} is set but RANK is not: start the ranks with torchrun, srun, "
                               "mpirun or scalerl launch, or unset WORLD_SIZE for a single process")
        rank = int(os.environ["RANK"])
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        store = rendezvous_store(addr, port, rank, world_size, rendezvous_timeout_s)
        options = {}
        if device.type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            enable_nccl_flight_recorder(trace_dir)
            options["device_id"] = torch.device("cuda", local_rank)  # NCCL joins now, not at the first collective
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=dist_timeout_s), **options)
        except (dist.DistError, RuntimeError) as e:
            raise RendezvousError(f"rank {rank} of {world_size} met the others at {addr}:{port} but could not form "
                                  f"the process group within trainer.rendezvous_timeout_s={rendezvous_timeout_s:g} "
                                  f"s: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        store.set_timeout(timedelta(seconds=dist_timeout_s))  # joined: later store waits are collectives
        _JOINED.update(timeout_s=dist_timeout_s, heartbeat=RankHeartbeat(addr, port, rank, world_size))
    mesh, dp_mesh = dims.build_mesh(device.type)
    return DistContext(dims, mesh, dp_mesh, rank=dist.get_rank(), device=device)


# The group this process formed in `init_distributed` (like torch's own default group, one per process):
# its collective limit and heartbeat, which `describe_failure` reports on.
_JOINED: dict = {"timeout_s": None, "heartbeat": None}


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
