"""Bandwidth the way nccl-tests measures it: an all-reduce sweep over message sizes (algbw = size / time,
busbw = algbw x 2(n-1)/n, the rate each rank's link carries in a ring), within each node and between
nodes (one rank per node), and point-to-point exchanges between every pair of nodes to find one slow link.

Every rank calls `measure_bandwidth` (it creates subgroups, which is collective); ranks outside a
measurement wait at its end. The time of a size is the slowest rank's, as a collective ends when its last
rank does.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from scalerl.doctor.world import DoctorWorld
from scalerl.health.node_rules import node_names

MiB = 2**20


def sweep_sizes(min_size: int, max_size: int) -> list[int]:
    """Powers of two from ``min_size`` up to ``max_size`` (both kept)."""
    sizes, size = [], max(4, min_size)
    while size < max_size:
        sizes.append(size)
        size *= 2
    return sizes + [max_size]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_barrier(group, device: torch.device) -> None:
    """A barrier that works on gloo and NCCL groups alike: a one-element all-reduce."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _sync(device)


def _slowest(seconds: float, group, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def all_reduce_sweep(group, group_size: int, sizes: list[int], iters: int, device: torch.device) -> list[dict]:
    results = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)  # warm-up: connections, buffers
        _group_barrier(group, device)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf, group=group)
        _sync(device)
        seconds = _slowest((time.perf_counter() - start) / iters, group, device)
        algbw = size / seconds
        results.append({"size": size, "time_s": seconds, "algbw": algbw, "busbw": algbw * 2 * (group_size - 1) / group_size})
    return results


def _exchange(peer: int, size: int, iters: int, device: torch.device) -> float:
    """Seconds per simultaneous exchange of ``size`` bytes each way with ``peer`` (a default-group rank)."""
    send = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def once():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
            work.wait()

    once()  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        once()
    _sync(device)
    return (time.perf_counter() - start) / iters


def round_robin(players: list[int]) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method); None pads an odd count."""
    items: list[int | None] = list(players) + ([None] if len(players) % 2 else [])
    rounds = []
    for _ in range(len(items) - 1):
        half = len(items) // 2
        pairs = [(items[i], items[-1 - i]) for i in range(half)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        items = [items[0], items[-1], *items[1:-1]]
    return rounds


def nominal_link(world: DoctorWorld, backend: str) -> dict[str, Any]:
    """The slowest node's speed for traffic between nodes: its InfiniBand ports under NCCL, else the
    interface collectives use (GLOO/NCCL_SOCKET_IFNAME, or the route to MASTER_ADDR)."""
    names = node_names(world.facts)
    per_node: dict[str, dict[str, Any]] = {}
    for f in world.facts:
        host = names[f["node_id"]]
        if host in per_node:
            continue
        ib = [p for p in f.get("rdma_ports", []) if p.get("rate_mbit") and "ACTIVE" in p.get("state", "")]
        socket_facts = f.get("socket") or {}
        if "nccl" in backend and ib:
            per_node[host] = {"interface": f"{ib[0]['device']} ({ib[0]['link_layer']})",
                              "mbit": min(p["rate_mbit"] for p in ib), "host": host}
        elif socket_facts.get("kind") == "virtual":
            per_node[host] = {"why": f"{socket_facts.get('interface')} on {host} is a "
                                     f"{socket_facts.get('virtual_kind') or 'virtual'} interface: no nominal speed"}
        elif socket_facts.get("speed_mbit"):
            per_node[host] = {"interface": socket_facts["interface"], "mbit": socket_facts["speed_mbit"], "host": host}
        else:
            per_node[host] = {"why": f"interface {socket_facts.get('interface') or '?'} on {host} reports no speed"}
    unknown = [n["why"] for n in per_node.values() if "why" in n]
    if unknown:
        return {"why": "; ".join(unknown)}
    slowest = min(per_node.values(), key=lambda n: n["mbit"])
    return {"interface": slowest["interface"], "host": slowest["host"], "bytes_per_s": slowest["mbit"] * 1e6 / 8}


def measure_bandwidth(world: DoctorWorld, sizes: list[int], iters: int, device: torch.device, backend: str,
                      timeout_s: float) -> dict[str, Any]:
    """Sweeps and pair exchanges; the same dict on every rank (``sweeps``, ``pairs``, ``nominal``, ``nodes``)."""
    names = node_names(world.facts)
    node_of = {f["rank"]: names[f["node_id"]] for f in world.facts}
    nodes: dict[str, list[int]] = {}
    for rank in world.joined:
        nodes.setdefault(node_of[rank], []).append(world.joined.index(rank))  # group ranks
    me = world.group_rank
    mine = node_of[world.rank]
    sweeps: list[dict[str, Any]] = []
    # Groups are created by every rank, in the same order, whether or not it belongs to them.
    intra = {node: dist.new_group(ranks) for node, ranks in nodes.items() if len(ranks) > 1} if len(nodes) > 1 else {}
    leaders = [ranks[0] for ranks in nodes.values()]
    inter = dist.new_group(leaders) if len(nodes) > 1 else None
    if len(nodes) == 1:
        sweeps.append({"scope": "intra-node", "node": mine, "ranks": world.joined,
                       "results": all_reduce_sweep(None, world.size, sizes, iters, device)})
    else:
        local = None
        if mine in intra:
            local = {"scope": "intra-node", "node": mine, "ranks": [world.joined[r] for r in nodes[mine]],
                     "results": all_reduce_sweep(intra[mine], len(nodes[mine]), sizes, iters, device)}
        gathered = world.all_gather_json("intra", local if local and me == nodes[mine][0] else None, timeout_s)
        sweeps += [s for s in gathered if s]
        result = all_reduce_sweep(inter, len(leaders), sizes, iters, device) if me in leaders else None
        gathered = world.all_gather_json("inter", result, timeout_s)
        sweeps.append({"scope": "inter-node", "ranks": [world.joined[r] for r in leaders],
                       "results": next(r for r in gathered if r)})
        if any(len(r) > 1 for r in nodes.values()):
            sweeps.append({"scope": "world", "ranks": world.joined,
                           "results": all_reduce_sweep(None, world.size, sizes, iters, device)})
    pairs = _pair_bandwidth(world, nodes, leaders, inter, min(sizes[-1], 64 * MiB), iters, device, timeout_s) \
        if len(nodes) > 1 else []
    return {"sweeps": sweeps, "pairs": pairs, "nodes": len(nodes), "nominal": nominal_link(world, backend)}


def _pair_bandwidth(world: DoctorWorld, nodes: dict[str, list[int]], leaders: list[int], inter, size: int,
                    iters: int, device: torch.device, timeout_s: float) -> list[dict[str, Any]]:
    """One round of disjoint node pairs at a time, so each exchange has its links to itself."""
    host_of_leader = {ranks[0]: node for node, ranks in nodes.items()}
    me = world.group_rank
    measured = []
    for pairs in round_robin(leaders):
        if me in leaders:
            for a, b in pairs:
                if me in (a, b):
                    seconds = _exchange(b if me == a else a, size, iters, device)
                    measured.append({"a": host_of_leader[a], "b": host_of_leader[b], "seconds": seconds})
            _group_barrier(inter, device)
    gathered = world.all_gather_json("pairs", measured, timeout_s)
    slowest: dict[tuple[str, str], float] = {}
    for entry in (e for per_rank in gathered for e in per_rank):
        key = (entry["a"], entry["b"])
        slowest[key] = max(slowest.get(key, 0.0), entry["seconds"])  # both ends timed it; the later decides
    return [{"a": a, "b": b, "size": size, "seconds": s, "bytes_per_s": size / s} for (a, b), s in slowest.items()]
