"""The ranks of a Ray job: one actor per rank in a placement group, ordered node by node, each given the
rendezvous environment (`create_rank_group`), and `run_on_ranks` to call a function in all of them.
Ray is imported inside the functions, so importing this module costs nothing where Ray is absent."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from scalerl.launch.ray_placement import (
    check_request,
    rank_bundles,
    ranks_per_node,
    reserve,
)


class RankFailure(RuntimeError):
    """A rank raised or its process died; `rank` says which, the message carries its error."""

    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"rank {rank} failed: {error}")
        self.rank = rank
        self.error = error



# ------------------------------------------------------------------------------------------ the actor
class RankWorker:
    """The process of one rank (wrapped by `ray.remote` in `create_rank_group`)."""

    def node_info(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in context.get_accelerator_ids().get("GPU", [])]}

    def free_port(self) -> int:
        """A TCP port free on this node right now (the rendezvous port, picked where it will be bound)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
            # torch already sized its thread pool from the old value; the variable alone no longer reaches it.
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


@dataclass
class RankGroup:
    """Rank actors (index = rank) living in their placement groups (the trainer's, and the standalone
    rollout workers' own); `shutdown()` frees them all."""

    placement_group: Any
    actors: list[Any]
    node_ids: list[str]  # per rank
    env: list[dict[str, str]] = field(default_factory=list)  # what each rank was given
    worker_placement_group: Any = None

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for group in (self.placement_group, self.worker_placement_group):
            if group is not None:
                remove_placement_group(group)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _rank_order(infos: list[dict[str, Any]]) -> list[int]:
    """Actor indices in rank order: node by node (nodes in order of their first bundle), then by GPU id,
    so ranks on a node are contiguous (what hierarchical collectives and LOCAL_RANK assume)."""
    node_order: dict[str, int] = {}
    for info in infos:
        node_order.setdefault(info["node_id"], len(node_order))

    def key(i: int) -> tuple:
        gpus = infos[i]["gpu_ids"]
        return node_order[infos[i]["node_id"]], [(len(g), g) for g in gpus], i  # numeric order of "10" vs "9"

    return sorted(range(len(infos)), key=key)


def _rank_env(infos: list[dict[str, Any]], master_addr: str, master_port: int, cpus_per_rank: float,
              gpus: bool, extra_env: dict[str, str] | None) -> list[dict[str, str]]:
    """Environment per rank (`infos` already in rank order)."""
    node_ids = list(dict.fromkeys(info["node_id"] for info in infos))
    per_node = {nid: [i for i, info in enumerate(infos) if info["node_id"] == nid] for nid in node_ids}
    passthrough = ("NCCL_SOCKET_IFNAME",) if gpus else ("GLOO_SOCKET_IFNAME",)
    envs = []
    for rank, info in enumerate(infos):
        peers = per_node[info["node_id"]]
        env = {
            "RANK": str(rank), "WORLD_SIZE": str(len(infos)),
            "LOCAL_RANK": str(peers.index(rank)), "LOCAL_WORLD_SIZE": str(len(peers)),
            "GROUP_RANK": str(node_ids.index(info["node_id"])),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "OMP_NUM_THREADS": str(max(1, int(cpus_per_rank))),
        }
        if gpus:
            # Ray shows each actor only its own GPU; show it the node's ranks' GPUs, in local-rank order, so
            # cuda:LOCAL_RANK is its own device and NCCL can see its peers for P2P.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for i in peers for g in infos[i]["gpu_ids"])
        env.update({name: os.environ[name] for name in passthrough if name in os.environ})
        env.update(extra_env or {})
        envs.append(env)
    return envs


def create_rank_group(num_nodes: int, gpus_per_node: int, cpus_per_rank: float = 1.0, strategy: str = "PACK",
                      timeout_s: float = 120.0, extra_env: dict[str, str] | None = None,
                      rollout_workers: int = 0) -> RankGroup:
    """Reserve one bundle per node and start one `RankWorker` per rank, ready for `env://` rendezvous.

    Ray must already be initialized. Each actor gets `cpus_per_rank` CPUs and one GPU (none when
    `gpus_per_node` is 0) from its node's bundle, and RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
    GROUP_RANK / MASTER_ADDR (rank 0's node) / MASTER_PORT (free on rank 0's node) / OMP_NUM_THREADS
    (+ CUDA_VISIBLE_DEVICES on GPU, GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME from the caller, `extra_env`).
    Raises PlacementError, naming the bundles and the cluster's resources, when the request is impossible
    (checked before reserving) or not placed within `timeout_s`. ``rollout_workers`` more ranks (the last
    ones, one CPU set and GPU each) get a placement group of their own, so they may land on other nodes.
    """
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_request(num_nodes, gpus_per_node, cpus_per_rank, strategy)
    group = reserve(rank_bundles(num_nodes, gpus_per_node, cpus_per_rank), strategy, timeout_s)
    worker_group = None
    per_node = ranks_per_node(gpus_per_node)
    actors: list[Any] = []
    try:
        worker = ray.remote(RankWorker)
        options = dict(num_cpus=cpus_per_rank, num_gpus=1 if gpus_per_node else 0)
        for bundle in range(num_nodes):
            placement = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
            actors += [worker.options(**options, scheduling_strategy=placement).remote() for _ in range(per_node)]
        if rollout_workers:
            worker_group = reserve(rank_bundles(rollout_workers, min(gpus_per_node, 1), cpus_per_rank), strategy,
                                   timeout_s)
            actors += [worker.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=worker_group, placement_group_bundle_index=b)).remote() for b in range(rollout_workers)]
        infos = ray.get([a.node_info.remote() for a in actors], timeout=timeout_s)
        trainers = len(actors) - rollout_workers  # trainer ranks first, node by node; then the workers
        order = _rank_order(infos[:trainers]) + [trainers + i for i in _rank_order(infos[trainers:])]
        actors, infos = [actors[i] for i in order], [infos[i] for i in order]
        port = ray.get(actors[0].free_port.remote(), timeout=timeout_s)
        envs = _rank_env(infos, infos[0]["ip"], port, cpus_per_rank, gpus_per_node > 0, extra_env)
        ray.get([a.set_env.remote(env) for a, env in zip(actors, envs)], timeout=timeout_s)
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for reserved in (group, worker_group):
            if reserved is not None:
                remove_placement_group(reserved)
        raise
    return RankGroup(group, actors, [info["node_id"] for info in infos], envs, worker_group)


def run_on_ranks(actors: Sequence[Any], fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
                 **kwargs: Any) -> list[Any]:
    """Call `fn(*args, **kwargs)` in every rank actor at once; results in rank order.

    Returns as soon as any rank fails, raising RankFailure for it: its peers are then typically stuck in a
    collective waiting for it, so the caller should shut the group down rather than wait for them.
    """
    import ray

    refs = [actor.run.remote(fn, *args, **kwargs) for actor in actors]
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not done:
            raise TimeoutError(f"ranks {sorted(rank_of[r] for r in pending)} did not finish within {timeout_s:g} s")
        try:
            ray.get(done[0])
        except Exception as e:  # RayTaskError carries the rank's traceback; RayActorError a dead process
            raise RankFailure(rank_of[done[0]], e) from e
    return ray.get(refs)
