"""The process group and mesh a run uses, and the counted collectives the trainer issues.

A single process gets the same object with sizes of 1 and no-op collectives, so the trainer has one code
path for every layout. With standalone rollout workers the world holds the trainer's ranks first and the
workers' ranks last; the mesh and `group` span the trainer's ranks only. Every collective here runs on a
named group (`over`: the DP ranks, the trainer's ranks, the rollout group), never on the whole world, and
counts this rank's bytes and wait in `comm` under its kind and mesh dimension. Nothing waits without a limit: joining the group is bounded by the
rendezvous limit, every collective by the collective limit (`scalerl.parallel.process_group`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from scalerl.comm.counting.accounting import CommCounter, process_counter
from scalerl.comm.net.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.net.rank_placement import RankPlacement, plan_rank_placement
from scalerl.comm.net.socket_interface import apply_socket_interface
from scalerl.comm.net.topology import detect_topology
from scalerl.core.rank_env import RankEnvError, apply_rank_env, detect_rank_env
from scalerl.parallel.mesh import LayoutError, ParallelDims
from scalerl.parallel.process_group import join_process_group

logger = logging.getLogger(__name__)
# A collective's group: "dp", "trainer", "rollout" (see `DistContext.group_of`) or a process group.
Over = Union[str, dist.ProcessGroup]
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """torch 2.13's name for the tensor all-gather (the old name warns on every rank; older torch has only it),
    looked up at each call so a wrapper patched onto torch.distributed (the doctor's wait timing) sees it."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


@dataclass
class DistContext:
    dims: ParallelDims
    mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None = None
    rank: int = 0
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None  # the trainer's ranks; None: the whole world (no rollout workers)
    rollout_ranks: tuple[int, ...] = ()  # global ranks of standalone rollout workers
    rollout_group: dist.ProcessGroup | None = None  # the trainer's rank 0 and the workers (weight sync)
    comm: CommCounter = field(default_factory=process_counter)  # this process's byte accounting
    cluster: ClusterTopology | None = None  # every rank's node and network, gathered once at start
    placement: RankPlacement | None = None  # which global rank of the trainer sits at each mesh position

    @property
    def is_trainer(self) -> bool:
        return self.rank not in self.rollout_ranks

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

    # ---- counted collectives: each counts this rank's bytes (kind, mesh dimension) and its wait ----------
    def group_of(self, over: Over) -> tuple[dist.ProcessGroup | None, int, str | None]:
        """(group, size, counter dimension) of ``over``: ``"dp"`` (the data-parallel ranks; TP/PP peers hold
        the same values), ``"trainer"`` (every trainer rank), ``"rollout"`` (the trainer's rank 0 and the
        standalone workers) or a process group (dimension: None unless the call names one)."""
        if over == "dp":
            return self.dp_group, self.dims.dp, "dp"
        if over == "trainer":
            return self.group, self.world_size, None
        if over == "rollout":
            return self.rollout_group, len(self.rollout_ranks) + 1 if self.rollout_ranks else 1, "rollout_workers"
        if isinstance(over, str):
            raise ValueError(f"unknown group {over!r}: 'dp', 'trainer', 'rollout' or a process group")
        return over, dist.get_world_size(over), None

    def all_reduce(self, tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", *, over: Over = "dp",
                   kind: str = "metrics", dim: str | None = None) -> torch.Tensor:
        """In-place reduction (``op``: "sum", "max", "min" or a ``ReduceOp``) over ``over`` (default: the
        data-parallel ranks), counted as ``kind`` traffic (default ``metrics``: token counts, statistics)."""
        group, size, default_dim = self.group_of(over)
        if size > 1:
            with self.comm.collective(kind, "all_reduce", tensor, group, dim=dim or default_dim):
                dist.all_reduce(tensor, op=REDUCE_OPS[op] if isinstance(op, str) else op, group=group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, over: Over = "dp", kind: str = "metrics",
                   dim: str | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` (one shape on all) concatenated along dim 0 in group-rank order."""
        group, size, default_dim = self.group_of(over)
        if size == 1:
            return tensor
        out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        with self.comm.collective(kind, "all_gather", out, group, dim=dim or default_dim):
            _all_gather_single(out, tensor.contiguous(), group=group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int | None = None, *, over: Over = "trainer",
                  kind: str = "metrics", dim: str | None = None) -> torch.Tensor:
        """``tensor`` from global rank ``src`` (default: the group's first rank) to every rank of ``over``, in place."""
        group, size, default_dim = self.group_of(over)
        if size > 1:
            src = src if src is not None else (dist.get_global_rank(group, 0) if group is not None else 0)
            with self.comm.collective(kind, "broadcast", tensor, group, dim=dim or default_dim, src=src):
                dist.broadcast(tensor, src=src, group=group)
        return tensor

    def all_to_all(self, tensor: torch.Tensor, *, over: Over = "dp", kind: str = "metrics",
                   dim: str | None = None) -> torch.Tensor:
        """``tensor`` cut into group-size equal chunks along dim 0, chunk j sent to group rank j; returns the
        chunks received, in group-rank order (same shape)."""
        group, size, default_dim = self.group_of(over)
        if size == 1:
            return tensor
        if tensor.shape[0] % size:
            raise ValueError(f"all_to_all: {tensor.shape[0]} rows do not split into {size} equal chunks")
        out = torch.empty_like(tensor)
        with self.comm.collective(kind, "all_to_all", tensor, group, dim=dim or default_dim):
            dist.all_to_all_single(out, tensor.contiguous(), group=group)
        return out

    def counted(self, kind: str, op: str, payload_bytes: int | None = None, *, over: Over = "trainer",
                src: int | None = None, dim: str | None = None):
        """A context manager counting one transfer made of several calls (a tensor message: its length,
        header and parts) as one ``op`` of ``payload_bytes`` over ``over``, and timing the block; the size
        may be set inside it, once known::

            with ctx.counted("rollout", "send", over="rollout") as transfer:
                transfer.payload_bytes = send_tensors(tensors, worker)

        ``src``: a broadcast's global source rank. A send counts its payload whatever the group."""
        group, _, default_dim = self.group_of(over)
        return self.comm.collective(kind, op, payload_bytes, group, dim=dim or default_dim, src=src)

    def all_finished(self, flag: bool) -> bool:
        """True once every trainer rank is done: ranks whose forwards hold collectives (FSDP all-gathers, TP
        all-reduces) must run the same number of decode steps."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.all_reduce(t, op="min", over="trainer").item())

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every trainer rank: a decision only rank 0 can make (from a file it alone reads)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.broadcast(t, src=0, over="trainer").item())  # global rank 0: the trainer's first

    def barrier(self) -> None:
        """All trainer ranks meet here."""
        if self.world_size > 1:
            dist.barrier(group=self.group)


def single_process_context() -> DistContext:
    return DistContext(ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1), mesh=None)


def init_distributed(parallel_cfg, device: torch.device, rollout_workers: int = 0, dist_timeout_s: float = 600.0,
                     rendezvous_timeout_s: float = 120.0, trace_dir: str | Path | None = None) -> DistContext:
    """Join the process group described by the launcher's environment (torchrun, Slurm, MPI, Ray all end
    with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) and build the named mesh over the trainer's ranks.

    ``rollout_workers``: the last ranks of the world that run standalone rollout workers instead of training
    (every rank calls this, the workers too: group creation is collective). Joining waits at most
    ``rendezvous_timeout_s``, each collective at most ``dist_timeout_s``; ``trace_dir`` receives NCCL's
    flight-recorder dumps (`scalerl.parallel.process_group.join_process_group`)."""
    env = detect_rank_env()
    if env is not None:
        apply_rank_env(env)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer_world = world_size - rollout_workers
    if trainer_world < 1:
        raise LayoutError(f"rollout.workers={rollout_workers} leaves no trainer rank in a world of {world_size}; "
                          "start rollout.workers more ranks than the training layout needs")
    if world_size == 1:
        ParallelDims.from_config(parallel_cfg, 1)  # a layout asking for more ranks fails here, by name
        return single_process_context()
    dims = ParallelDims.from_config(parallel_cfg, trainer_world)
    record = detect_topology()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # WORLD_SIZE alone, e.g. left over in a shell
            raise RankEnvError(f"WORLD_SIZE={world_size} is set but RANK is not: start the ranks with torchrun, srun, "
                               "mpirun or scalerl launch, or unset WORLD_SIZE for a single process")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Before the group starts: a virtual / link-local default route would send gloo / NCCL's sockets
        # the wrong way (a hang at the first collective); a named interface missing here fails now, by name.
        choice = apply_socket_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"), record, os.environ)
        (logger.warning if choice.name and choice.variable is None else logger.info)(
            "socket interface on %s (rank %s): %s", record.hostname, record.rank, choice.reason)
        join_process_group(int(os.environ["RANK"]), world_size, device, dist_timeout_s, rendezvous_timeout_s,
                           trace_dir)
    cluster = gather_topology(record=record)  # over the whole world: every rank calls this
    placement = RankPlacement(tuple(range(trainer_world)))  # the launcher's order
    if getattr(parallel_cfg, "reorder_ranks_by_node", True):
        placement = plan_rank_placement(cluster.node_of_rank[:trainer_world], dims.tp)
    if dist.get_rank() == 0:
        logger.info("cluster topology:\n%s", cluster.summary())
        for note in placement.notes:
            logger.warning("rank placement: %s", note)
    mesh, dp_mesh = dims.build_mesh(device.type, list(placement.order))
    counter = process_counter()
    counter.backend = dist.get_backend()
    counter.reset()
    context = dict(rank=dist.get_rank(), device=device, comm=counter, cluster=cluster, placement=placement)
    if not rollout_workers:
        return DistContext(dims, mesh, dp_mesh, **context)
    group = dist.new_group(list(range(trainer_world)))
    workers = tuple(range(trainer_world, world_size))
    # The trainer's rank 0 and the workers: the group weight sync broadcasts over (created by every rank).
    sync_group = dist.new_group([0, *workers])
    return DistContext(dims, mesh, dp_mesh, group=group, rollout_ranks=workers, rollout_group=sync_group, **context)
