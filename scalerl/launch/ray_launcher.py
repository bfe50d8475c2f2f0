"""Launch training on a Ray cluster: one placement-group bundle per node, one actor per rank.

Ray only decides where ranks run and how they find each other; every rank then makes the same call as
under torchrun or Slurm, `train(config)` with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT` set. The pieces are reusable on their own (e.g. by a rollout worker group):

- `create_rank_group(...)` reserves the bundles, starts the rank actors, orders ranks node by node and
  exports the rendezvous variables in each actor; it fails with a readable report instead of waiting
  forever when the cluster cannot hold the request;
- `run_on_ranks(actors, fn, *args)` calls `fn` in every rank at once and returns the results in rank
  order, or raises `RankFailure` naming the first rank that failed;
- `launch_ray(...)` is the `scalerl launch ray` entry point built from the two.

Ray is imported inside the functions so that importing this module costs nothing where Ray is absent.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from scalerl.core.config import ConfigError, load_config

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
# Ray's bookkeeping resources, not something a user asks for: left out of reports.
_INTERNAL_RESOURCE_PREFIXES = ("node:", "accelerator_type:", "memory", "object_store_memory")
# Ray stores resources in fixed point (1e-4); without slack 2.0 / 0.4 would count as 4 bundles, not 5.
_FIT_SLACK = 1e-6


class PlacementError(RuntimeError):
    """The cluster cannot (or did not in time) hold the requested bundles; the message says why."""


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
    """Rank actors (index = rank) living in one placement group; `shutdown()` frees both."""

    placement_group: Any
    actors: list[Any]
    node_ids: list[str]  # per rank
    env: list[dict[str, str]] = field(default_factory=list)  # what each rank was given

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# -------------------------------------------------------------------------------- placement checks
def ranks_per_node(gpus_per_node: int) -> int:
    """One rank per GPU; one rank per node on CPU."""
    return gpus_per_node if gpus_per_node > 0 else 1


def rank_bundles(num_nodes: int, gpus_per_node: int, cpus_per_rank: float) -> list[dict[str, float]]:
    """One bundle per node, holding all of that node's ranks."""
    bundle = {"CPU": cpus_per_rank * ranks_per_node(gpus_per_node)}
    if gpus_per_node > 0:  # a zero-valued resource in a bundle is noise in every report
        bundle["GPU"] = float(gpus_per_node)
    return [dict(bundle) for _ in range(num_nodes)]


def _bundles_fitting(bundle: dict[str, float], node: dict[str, float]) -> int:
    return min(math.floor(node.get(r, 0.0) / need + _FIT_SLACK) for r, need in bundle.items() if need > 0)


def placement_problems(bundles: Sequence[dict[str, float]], strategy: str,
                       nodes: Sequence[dict[str, float]]) -> list[str]:
    """Why `bundles` (all alike) can never be placed on `nodes` (resources per node); empty if they can.

    Exact for identical bundles: a node holds floor(min over resources of node / bundle) of them, SPREAD and
    PACK may stack several on a node, STRICT_SPREAD one per node, STRICT_PACK all on one node.
    """
    if not bundles:
        return []
    n, bundle = len(bundles), bundles[0]
    problems = []
    for r, need in bundle.items():
        total = sum(node.get(r, 0.0) for node in nodes)
        if n * need > total + _FIT_SLACK:
            problems.append(f"{r}: {n} bundle(s) x {need:g} = {n * need:g} requested, the cluster has {total:g}")
        largest = max((node.get(r, 0.0) for node in nodes), default=0.0)
        if need > largest + _FIT_SLACK:
            problems.append(f"{r}: each bundle needs {need:g} on one node, the largest node has {largest:g}")
    if problems:
        return problems
    fits = [_bundles_fitting(bundle, node) for node in nodes]
    if strategy == "STRICT_SPREAD":
        holding = sum(f >= 1 for f in fits)
        if holding < n:
            problems.append(f"STRICT_SPREAD puts each of the {n} bundles on its own node, "
                            f"but only {holding} of the {len(nodes)} node(s) can hold one")
    elif strategy == "STRICT_PACK":
        if max(fits, default=0) < n:
            problems.append(f"STRICT_PACK puts all {n} bundles on one node, but a node holds at most {max(fits)}")
    elif sum(fits) < n:
        problems.append(f"only {sum(fits)} of the {n} bundles fit (per node: {fits}); "
                        "nodes with different resources leave room that no bundle can use")
    return problems


def _resources_text(resources: dict[str, float], always: tuple[str, ...] = ("CPU", "GPU")) -> str:
    shown = {r: resources.get(r, 0.0) for r in always}  # a cluster's "GPU 0" is news; a bundle's is noise
    shown.update({r: v for r, v in resources.items() if not r.startswith(_INTERNAL_RESOURCE_PREFIXES)})
    return ", ".join(f"{r} {v:g}" for r, v in shown.items())


def _placement_report(bundles: list[dict[str, float]], strategy: str, problems: list[str],
                      nodes: list[dict[str, Any]]) -> str:
    import ray

    lines = [f"cannot place {len(bundles)} bundle(s) of {{{_resources_text(bundles[0], always=()) if bundles else ''}}} "
             f"with strategy {strategy}:"]
    lines += [f"  - {p}" for p in problems]
    lines.append(f"cluster resources: {_resources_text(ray.cluster_resources())} "
                 f"(available now: {_resources_text(ray.available_resources())})")
    lines.append(f"alive nodes ({len(nodes)}):")
    lines += [f"  {n['NodeID'][:12]} {n['NodeManagerAddress']}: {_resources_text(n['Resources'])}" for n in nodes]
    return "\n".join(lines)


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


# ---------------------------------------------------------------------------------------- rank group
def _check_request(num_nodes: int, gpus_per_node: int, cpus_per_rank: float, strategy: str) -> None:
    if num_nodes < 1:
        raise ConfigError(f"num_nodes must be >= 1, got {num_nodes}")
    if gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
    if cpus_per_rank <= 0:
        raise ConfigError(f"cpus_per_rank must be > 0, got {cpus_per_rank}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"placement strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def _reserve(bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> Any:
    """A ready placement group, or PlacementError (checked up front, and again after a timeout)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = _alive_nodes()
    problems = placement_problems(bundles, strategy, [n["Resources"] for n in nodes])
    if problems:
        raise PlacementError(_placement_report(bundles, strategy, problems, nodes))
    group = placement_group(bundles, strategy=strategy)
    if group.wait(timeout_seconds=timeout_s):
        return group
    remove_placement_group(group)  # a pending group would grab the resources as soon as they free up
    nodes = _alive_nodes()
    problems = placement_problems(bundles, strategy, [n["Resources"] for n in nodes])
    if not problems:  # possible in principle, so something holds the resources or nodes are still joining
        problems = [f"not placed within {timeout_s:g} s: the nodes have the resources in total but not free "
                    "(other jobs, actors or placement groups hold them; see 'available now') or not yet joined"]
    raise PlacementError(_placement_report(bundles, strategy, problems, nodes))


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
                      timeout_s: float = 120.0, extra_env: dict[str, str] | None = None) -> RankGroup:
    """Reserve one bundle per node and start one `RankWorker` per rank, ready for `env://` rendezvous.

    Ray must already be initialized. Each actor gets `cpus_per_rank` CPUs and one GPU (none when
    `gpus_per_node` is 0) from its node's bundle, and RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
    GROUP_RANK / MASTER_ADDR (rank 0's node) / MASTER_PORT (free on rank 0's node) / OMP_NUM_THREADS
    (+ CUDA_VISIBLE_DEVICES on GPU, GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME from the caller, `extra_env`).
    Raises PlacementError, naming the bundles and the cluster's resources, when the request is impossible
    (checked before reserving) or not placed within `timeout_s`.
    """
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _check_request(num_nodes, gpus_per_node, cpus_per_rank, strategy)
    group = _reserve(rank_bundles(num_nodes, gpus_per_node, cpus_per_rank), strategy, timeout_s)
    per_node = ranks_per_node(gpus_per_node)
    actors: list[Any] = []
    try:
        worker = ray.remote(RankWorker)
        for bundle in range(num_nodes):
            placement = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
            actors += [worker.options(num_cpus=cpus_per_rank, num_gpus=1 if gpus_per_node else 0,
                                      scheduling_strategy=placement).remote() for _ in range(per_node)]
        infos = ray.get([a.node_info.remote() for a in actors], timeout=timeout_s)
        order = _rank_order(infos)
        actors, infos = [actors[i] for i in order], [infos[i] for i in order]
        port = ray.get(actors[0].free_port.remote(), timeout=timeout_s)
        envs = _rank_env(infos, infos[0]["ip"], port, cpus_per_rank, gpus_per_node > 0, extra_env)
        ray.get([a.set_env.remote(env) for a, env in zip(actors, envs)], timeout=timeout_s)
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
        raise
    return RankGroup(group, actors, [info["node_id"] for info in infos], envs)


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


# ------------------------------------------------------------------------------------------ launcher
def _default_train(cfg: Any) -> dict[str, Any]:
    from scalerl.trainer.rl_trainer import train

    return train(cfg)


def _print_summary(summary: dict[str, Any], world_size: int) -> None:
    print(f"ray launch: {world_size} rank(s) finished; final metrics (rank 0):")
    for key, value in sorted((summary or {}).get("last", {}).items()):
        print(f"  {key} = {value:.6g}" if isinstance(value, float) else f"  {key} = {value}")
    for key, value in (summary or {}).items():
        if key not in ("last", "initial"):
            print(f"  {key}: {value}")


def launch_ray(config_path: str | None, overrides: list[str], num_nodes: int, gpus_per_node: int,
               cpus_per_rank: float = 1.0, strategy: str = "PACK", address: str | None = None,
               dashboard_host: str = "127.0.0.1", timeout_s: float = 120.0,
               train_fn: Callable[[Any], dict[str, Any]] | None = None, max_restarts: int = 0) -> int:
    """Run `train_fn(cfg)` (default: GRPO `train`) on `num_nodes` x ranks_per_node Ray actors; exit code.

    The config is loaded and validated before Ray is touched (ConfigError propagates). Connects to
    `address` ("auto" or host:port), reuses the connection if Ray is already initialized, or starts a local
    Ray whose dashboard (if installed) binds to `dashboard_host`. Returns 0 after printing rank 0's final
    metrics, 1 when a rank fails (its error on stderr), 2 when the cluster cannot hold the ranks.
    Every node needs scalerl installed (the actors import it); outputs are written on the ranks' nodes.

    Restarts (`max_restarts`): when a rank fails or its process dies, its peers are stuck in collectives
    with it, so the whole group is torn down and started afresh (new actors, new rendezvous port), up to
    `max_restarts` times; each attempt carries SCALERL_JOB_ID and SCALERL_RESTART_COUNT, so the trainer
    continues from the latest checkpoint of the directory this job started in. (Ray's per-actor
    `max_restarts` would restart one rank alone, which SPMD training cannot use.) A rank that fails on bad
    input (a ConfigError, e.g. an output directory in use) is not restarted.
    """
    _check_request(num_nodes, gpus_per_node, cpus_per_rank, strategy)
    if max_restarts < 0:
        raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
    cfg = load_config(config_path, overrides)
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"the Ray launcher needs ray: pip install 'scalerl[ray]' ({e})") from None

    started_here = not ray.is_initialized()
    if started_here:
        address = address or os.environ.get("RAY_ADDRESS")  # what `ray.init()` itself would connect to
        if address is None:  # a fresh local Ray; its dashboard (if installed) only on `dashboard_host`
            ray.init(dashboard_host=dashboard_host)
        else:  # an existing cluster's dashboard is already bound; passing a host there is an error
            ray.init(address=address)
    job = {"SCALERL_JOB_ID": uuid.uuid4().hex}
    try:
        for attempt in range(max_restarts + 1):
            code, summaries = _run_attempt(cfg, train_fn, num_nodes, gpus_per_node, cpus_per_rank, strategy,
                                           timeout_s, {**job, "SCALERL_RESTART_COUNT": str(attempt)})
            if code != RESTARTABLE or attempt == max_restarts:
                break
            print(f"ray launch: restarting the job ({attempt + 1}/{max_restarts}) from its latest checkpoint",
                  file=sys.stderr, flush=True)
    finally:
        if started_here:
            ray.shutdown()
    if code != 0:
        return 1 if code == RESTARTABLE else code
    _print_summary(summaries[0], len(summaries))
    return 0


RESTARTABLE = -1  # an attempt's result: a rank failed in a way a restart may get past


def _run_attempt(cfg: Any, train_fn: Callable[[Any], dict[str, Any]] | None, num_nodes: int, gpus_per_node: int,
                 cpus_per_rank: float, strategy: str, timeout_s: float,
                 env: dict[str, str]) -> tuple[int, list[Any]]:
    """One start of every rank: (0, summaries), (2, []) when unplaceable, (1, []) after a rank failed on bad
    input, (RESTARTABLE, []) after any other rank failure. The group is shut down either way."""
    group = None
    try:
        group = create_rank_group(num_nodes, gpus_per_node, cpus_per_rank, strategy, timeout_s, extra_env=env)
        print(f"ray launch: {len(group.actors)} rank(s) on {len(set(group.node_ids))} node(s) ({strategy}), "
              f"master {group.env[0]['MASTER_ADDR']}:{group.env[0]['MASTER_PORT']}", flush=True)
        return 0, run_on_ranks(group.actors, train_fn or _default_train, cfg)
    except PlacementError as e:
        print(f"ray launch: {e}", file=sys.stderr)
        return 2, []
    except RankFailure as e:
        print(f"ray launch: {e}", file=sys.stderr)
        return (1 if isinstance(getattr(e.error, "cause", None), ConfigError) else RESTARTABLE), []
    finally:
        if group is not None:
            group.shutdown()
