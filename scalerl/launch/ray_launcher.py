"""`scalerl launch ray`: run training on a Ray cluster, one actor per rank.

Ray only decides where ranks run and how they find each other; every rank then makes the same call as
under torchrun or Slurm, `train(config)` with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT` set. The pieces are reusable on their own (e.g. by a rollout worker group):
`scalerl.launch.ray_placement` (bundles, placement reports) and `scalerl.launch.ray_ranks`
(`create_rank_group`, `run_on_ranks`).
"""

from __future__ import annotations

import sys
import uuid
from typing import Any, Callable

from scalerl.core.config import ConfigError, load_config
from scalerl.core.errors import UserError
from scalerl.launch.ray_connect import connect_ray
from scalerl.launch.ray_placement import (
    PlacementError,
    check_request,
    placement_problems,
    rank_bundles,
)
from scalerl.launch.ray_ranks import RankFailure, create_rank_group, run_on_ranks
from scalerl.trainer.run_checks import check_run_inputs

__all__ = ["PlacementError", "RankFailure", "create_rank_group", "launch_ray", "placement_problems", "rank_bundles",
           "run_on_ranks"]


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
               train_fn: Callable[[Any], dict[str, Any]] | None = None, max_restarts: int = 0,
               connect_timeout_s: float = 30.0) -> int:
    """Run `train_fn(cfg)` (default: GRPO `train`) on `num_nodes` x ranks_per_node Ray actors; exit code.

    The config is loaded and validated, and checked against the model and output directories it names,
    before Ray is touched (ConfigError propagates). Connects to `address` ("auto" or host:port; unreachable
    for `connect_timeout_s` is an error naming it), reuses the connection if Ray is already initialized, or
    starts a local Ray bound to 127.0.0.1 whose dashboard (if installed) binds to `dashboard_host`
    (`scalerl.launch.ray_connect`). Returns 0 after printing rank 0's final metrics, 1 when a rank fails (its
    error on stderr), 2 when the cluster cannot hold the ranks or a rank refused its input.
    Every node needs scalerl installed (the actors import it); outputs are written on the ranks' nodes.

    Restarts (`max_restarts`): when a rank fails or its process dies, its peers are stuck in collectives
    with it, so the whole group is torn down and started afresh (new actors, new rendezvous port), up to
    `max_restarts` times; each attempt carries SCALERL_JOB_ID and SCALERL_RESTART_COUNT, so the trainer
    continues from the latest checkpoint of the directory this job started in. (Ray's per-actor
    `max_restarts` would restart one rank alone, which SPMD training cannot use.) A rank that fails on bad
    input (a UserError, e.g. an output directory in use) is not restarted: it ends with exit code 2.
    """
    check_request(num_nodes, gpus_per_node, cpus_per_rank, strategy)
    if max_restarts < 0:
        raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
    cfg = load_config(config_path, overrides)
    check_run_inputs(cfg, sft=False, import_reward=False)  # the reward may exist only where ranks run
    started_here = connect_ray(address, dashboard_host, connect_timeout_s)
    import ray

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
    """One start of every rank: (0, summaries), (2, []) when unplaceable or a rank refused its input (a
    UserError, reported like the CLI does), (RESTARTABLE, []) after any other rank failure. The group is
    shut down either way."""
    group = None
    try:
        workers = cfg.rollout.workers if cfg.rollout.placement == "standalone" else 0
        group = create_rank_group(num_nodes, gpus_per_node, cpus_per_rank, strategy, timeout_s, extra_env=env,
                                  rollout_workers=workers)
        print(f"ray launch: {len(group.actors)} rank(s) on {len(set(group.node_ids))} node(s) ({strategy}), "
              f"master {group.env[0]['MASTER_ADDR']}:{group.env[0]['MASTER_PORT']}", flush=True)
        return 0, run_on_ranks(group.actors, train_fn or _default_train, cfg)
    except PlacementError as e:
        print(f"ray launch: {e}", file=sys.stderr)
        return 2, []
    except RankFailure as e:
        cause = getattr(e.error, "cause", None)  # a RayTaskError carries the rank's own exception
        if isinstance(cause, UserError):  # bad input, reported like the CLI does and not restarted
            print(f"error: rank {e.rank}: {cause}", file=sys.stderr)
            return 2, []
        print(f"ray launch: {e}", file=sys.stderr)
        return RESTARTABLE, []
    finally:
        if group is not None:
            group.shutdown()
