"""`scalerl doctor --ray`: the doctor on Ray rank actors (the same placement and rendezvous as `scalerl
launch ray`), plus what only the driver sees: placement groups that stay pending, explained against each
node's resources instead of Ray's silent "waiting for placement group"."""

from __future__ import annotations

import os
from typing import Any

from scalerl.core.config import ConfigError
from scalerl.doctor.diagnose import DoctorOptions, diagnose
from scalerl.doctor.report import DoctorReport
from scalerl.health.cluster_rules import ray_placement
from scalerl.health.tree import Finding
from scalerl.launch.ray_placement import PlacementError, placement_problems

RANK_TIMEOUT_MARGIN_S = 120.0


def pending_placement_groups() -> dict[str, Any]:
    """Every pending placement group with why it cannot be placed now (``ray_placement``'s input)."""
    import ray

    table = ray.util.placement_group_table()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    resources = [n["Resources"] for n in nodes]
    available = ray.available_resources()
    pending = []
    for group_id, group in table.items():
        if group.get("state") != "PENDING":
            continue
        bundles = [dict(b) for _, b in sorted(group.get("bundles", {}).items())]
        strategy = group.get("strategy", "PACK")
        problems = placement_problems(bundles, strategy, resources) if bundles else []
        if problems:
            fix = "ask for what the nodes have (fewer or smaller bundles, another strategy) or add nodes"
        else:
            problems = ["the nodes could hold it, but the resources are taken now (available: " +
                        ", ".join(f"{k} {v:g}" for k, v in sorted(available.items()) if k in ("CPU", "GPU")) + ")"]
            fix = "free the resources other jobs, actors or placement groups hold (`ray status`), or wait"
        pending.append({"id": group_id, "name": group.get("name", ""), "strategy": strategy, "bundles": bundles,
                        "problems": problems, "nodes": [{"address": n["NodeManagerAddress"], "resources": {
                            k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")}} for n in nodes],
                        "fix": fix})
    return {"groups": len(table), "pending": pending}


def _rank_main(options: DoctorOptions) -> dict[str, Any]:
    """Runs in each rank actor: the doctor on this rank; the report (on rank 0) travels back as JSON."""
    code, report = diagnose(options)
    return {"code": code, "report": report.to_json() if report is not None else None}


def diagnose_on_ray(options: DoctorOptions, num_nodes: int, gpus_per_node: int, cpus_per_rank: float, strategy: str,
                    address: str | None) -> DoctorReport:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"--ray needs ray: pip install 'scalerl[ray]' ({e})") from None
    from scalerl.launch.ray_ranks import RankFailure, create_rank_group, run_on_ranks

    started_here = not ray.is_initialized()
    if started_here:
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
        else:  # a fresh local Ray, its dashboard (if installed) on loopback only
            ray.init(dashboard_host="127.0.0.1")
    try:
        placement = pending_placement_groups()
        try:
            group = create_rank_group(num_nodes, gpus_per_node, cpus_per_rank, strategy,
                                      timeout_s=options.join_timeout_s)
        except PlacementError as e:
            own = Finding("communication/topology", "ray_placement", "fault",
                          f"the doctor's own {num_nodes} bundle(s) cannot be placed: {e}".splitlines()[0],
                          {"report": str(e)}, "ask for what the nodes have (--num-nodes, --gpus-per-node, "
                          "--cpus-per-rank, --strategy) or free resources (`ray status`)")
            return DoctorReport(options.modes, ray_placement(placement) + [own], measurements={"ray": placement},
                                world={"world_size": 0, "joined": [], "missing": [], "nodes": {}, "launcher": "ray"})
        with group:
            try:
                results = run_on_ranks(group.actors, _rank_main, options,
                                       timeout_s=options.join_timeout_s + options.timeout_s + RANK_TIMEOUT_MARGIN_S)
            except RankFailure as e:
                raise RuntimeError(f"doctor on Ray: {e}") from e
        report = DoctorReport.from_json(results[0]["report"])
        report.measurements["ray"] = placement
        report.world["launcher"] = "ray"
        return report.with_findings(ray_placement(placement))
    finally:
        if started_here:
            ray.shutdown()
