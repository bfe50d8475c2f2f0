"""Where a Ray job's ranks go: one placement-group bundle per node, and why a request cannot be placed.

`placement_problems` is exact arithmetic on identical bundles and the nodes' resources, so an impossible
request fails at once with a report (requested bundles, the cluster's resources per node) instead of a
placement group that stays pending forever. Ray is imported inside the functions that talk to it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from scalerl.core.config import ConfigError

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
# Ray's bookkeeping resources, not something a user asks for: left out of reports.
_INTERNAL_RESOURCE_PREFIXES = ("node:", "accelerator_type:", "memory", "object_store_memory")
# Ray stores resources in fixed point (1e-4); without slack 2.0 / 0.4 would count as 4 bundles, not 5.
_FIT_SLACK = 1e-6


class PlacementError(RuntimeError):
    """The cluster cannot (or did not in time) hold the requested bundles; the message says why."""


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


def check_request(num_nodes: int, gpus_per_node: int, cpus_per_rank: float, strategy: str) -> None:
    if num_nodes < 1:
        raise ConfigError(f"num_nodes must be >= 1, got {num_nodes}")
    if gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
    if cpus_per_rank <= 0:
        raise ConfigError(f"cpus_per_rank must be > 0, got {cpus_per_rank}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"placement strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def reserve(bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> Any:
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
