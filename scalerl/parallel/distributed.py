"""The process group and mesh a run uses, and the few collectives the trainer needs on the DP dimension.

A single process gets the same object with sizes of 1 and no-op collectives, so the trainer has one code
path for every layout. With standalone rollout workers the world holds the trainer's ranks first and the
workers' ranks last; the mesh and `group` span the trainer's ranks only, and every collective here runs
on `group`, never on the whole world. Nothing waits without a limit: joining the group is bounded by the
rendezvous limit, every collective by the collective limit (`scalerl.parallel.process_group`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

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

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place reduction over the data-parallel ranks (TP/PP peers hold the same values already);
        counted as ``metrics`` traffic (token counts, advantage statistics)."""
        if self.dims.dp > 1:
            with self.comm.collective("metrics", "all_reduce", tensor, self.dp_group, dim="dp"):
                dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor

    def all_finished(self, flag: bool) -> bool:
        """True once every DP rank is done: ranks whose forwards hold collectives (FSDP all-gathers, TP
        all-reduces) must run the same number of decode steps."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        with self.comm.collective("metrics", "all_reduce", t, self.group):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every trainer rank: a decision only rank 0 can make (from a file it alone reads)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        with self.comm.collective("metrics", "broadcast", t, self.group):
            dist.broadcast(t, src=0, group=self.group)  # global rank 0 is the trainer's first rank
        return bool(t.item())

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
