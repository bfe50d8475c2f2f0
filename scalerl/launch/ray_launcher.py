"""`scalerl launch ray`: run training on a Ray cluster, one actor per rank.

Ray only decides where ranks run and how they find each other; every rank then makes the same call as
under torchrun or Slurm, `train(config)` with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT` set. The pieces are reusable on their own (e.g. by a rollout worker group):
`scalerl.launch.ray_placement` (bundles, placement reports) and `scalerl.launch.ray_ranks`
(`create_rank_group`, `run_on_ranks`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from scalerl.core.config import ConfigError, load_config
from scalerl.launch.ray_placement import PlacementError, check_request, placement_problems, rank_bundles
from scalerl.launch.ray_ranks import RankFailure, create_rank_group, run_on_ranks

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
               train_fn: Callable[[Any], dict[str, Any]] | None = None) -> int:
    """Run `train_fn(cfg)` (default: GRPO `train`) on `num_nodes` x ranks_per_node Ray actors; exit code.

    The config is loaded and validated before Ray is touched (ConfigError propagates). Connects to
    `address` ("auto" or host:port), reuses the connection if Ray is already initialized, or starts a local
    Ray whose dashboard (if installed) binds to `dashboard_host`. Returns 0 after printing rank 0's final
    metrics, 1 when a rank fails (its error on stderr), 2 when the cluster cannot hold the ranks.
    Every node needs scalerl installed (the actors import it); outputs are written on the ranks' nodes.
    """
    check_request(num_nodes, gpus_per_node, cpus_per_rank, strategy)
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
    group = None
    try:
        workers = cfg.rollout.workers if cfg.rollout.placement == "standalone" else 0
        group = create_rank_group(num_nodes, gpus_per_node, cpus_per_rank, strategy, timeout_s,
                                  rollout_workers=workers)
        print(f"ray launch: {len(group.actors)} rank(s) on {len(set(group.node_ids))} node(s) ({strategy}), "
              f"master {group.env[0]['MASTER_ADDR']}:{group.env[0]['MASTER_PORT']}", flush=True)
        summaries = run_on_ranks(group.actors, train_fn or _default_train, cfg)
    except PlacementError as e:
        print(f"ray launch: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"ray launch: {e}", file=sys.stderr)
        return 1
    finally:
        if group is not None:
            group.shutdown()
        if started_here:
            ray.shutdown()
    _print_summary(summaries[0], len(summaries))
    return 0
