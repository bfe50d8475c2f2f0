"""Which ranks share a node, and what to call the node: the hostname, or ``hostname[address]`` when several
nodes share one (network namespaces on one machine, cloned images). A node is a ``node_id`` (machine boot
and network namespace), as `scalerl.doctor.facts` reports it."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any


def node_names(facts: list[dict[str, Any]]) -> dict[str, str]:
    """node_id -> a readable name: the hostname, or hostname[address] where several nodes share a hostname
    (network namespaces on one machine, cloned images)."""
    hosts: dict[str, str] = {}
    for f in facts:
        hosts.setdefault(f["node_id"], f["hostname"])
    clash = {h for h, n in Counter(hosts.values()).items() if n > 1}
    names = {}
    for f in facts:
        if f["node_id"] in names:
            continue
        address = (f.get("socket") or {}).get("address") or f"node{f.get('node_rank', 0)}"
        names[f["node_id"]] = f"{f['hostname']}[{address}]" if f["hostname"] in clash else f["hostname"]
    return names


def nodes(facts: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Readable node name -> its ranks, nodes in order of their lowest rank."""
    names = node_names(facts)
    placement: dict[str, list[int]] = defaultdict(list)
    for f in sorted(facts, key=lambda f: f["rank"]):
        placement[names[f["node_id"]]].append(f["rank"])
    return dict(placement)
