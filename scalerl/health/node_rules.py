"""Cluster rules on the nodes: which ranks share a node and what to call it, devices, memory, host-device
copies and storage, from the distributed check's facts."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from scalerl.health.thresholds import RULES
from scalerl.health.tree import NOT_MEASURED, OK, Finding
from scalerl.health.wording import finding, ranges


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


def device_models(facts: list[dict[str, Any]]) -> list[Finding]:
    models = {f["rank"]: (f.get("gpus") or [{"name": f.get("device", "cpu")}])[min(
        f.get("local_rank", 0), len(f.get("gpus") or [None]) - 1)]["name"] for f in facts}
    kinds = Counter(models.values())
    if len(kinds) < 2:
        return [finding("device_models", OK, f"every rank runs on {next(iter(kinds))} (per-rank speed: the "
                         "per-rank phase table of --performance-profiling)")]
    majority = kinds.most_common(1)[0][0]
    odd = [r for r, m in models.items() if m != majority]
    return [finding("device_models", RULES["device_models"].severities["mixed"].status,
                     "device models differ: " + "; ".join(f"{m} on rank(s) {ranges(sorted(r for r in models if models[r] == m))}"
                                                          for m in kinds), {"models": models},
                     RULES["device_models"].fix, ranks=odd)]


def device_memory(facts: list[dict[str, Any]]) -> list[Finding]:
    thresholds = RULES["device_memory_free"].thresholds
    names = node_names(facts)
    rows = []
    for f in facts:
        if f.get("device") == "cuda" and f.get("gpus"):
            gpu = f["gpus"][min(f.get("local_rank", 0), len(f["gpus"]) - 1)]
            if gpu.get("free_gb") is not None:
                rows.append((f, gpu["free_gb"], gpu["memory_gb"], f"GPU {gpu['name']}", thresholds["free_fraction"]))
        elif f.get("memory"):
            rows.append((f, f["memory"]["available_gb"], f["memory"]["total_gb"], "host RAM",
                         thresholds["host_available_fraction"]))
    if not rows:
        return [finding("device_memory_free", NOT_MEASURED, "no device memory readable")]
    f, free, total, what, threshold = min(rows, key=lambda r: r[1] / r[2] if r[2] else 1.0)
    frac = free / total if total else 1.0
    status = threshold.status(frac)
    return [finding("device_memory_free", status, f"least free: {free:.1f} of {total:.1f} GiB {what} on "
                     f"{names[f['node_id']]} (rank {f['rank']}) before the run", {"free_gb": round(free, 2),
                                                                                 "total_gb": round(total, 2)},
                     RULES["device_memory_free"].fix, ranks=[f["rank"]] if status != OK else (),
                     hosts=[names[f["node_id"]]] if status != OK else ())]


def host_device_copy(facts: list[dict[str, Any]]) -> list[Finding]:
    copies = [(f, f["copy"]) for f in facts if f.get("copy")]
    if not copies:
        return [finding("host_device_copy", NOT_MEASURED, "no GPU on any rank: no host-device link to measure")]
    threshold = RULES["host_device_copy"].thresholds["gbytes_per_s"]
    f, c = min(copies, key=lambda fc: min(fc[1]["h2d_bytes_per_s"], fc[1]["d2h_bytes_per_s"]))
    slowest = min(c["h2d_bytes_per_s"], c["d2h_bytes_per_s"]) / 1e9
    status = threshold.status(slowest)
    return [finding("host_device_copy", status, f"slowest pinned copy {slowest:.1f} GB/s (rank {f['rank']}: "
                     f"host->device {c['h2d_bytes_per_s'] / 1e9:.1f}, device->host {c['d2h_bytes_per_s'] / 1e9:.1f} GB/s)",
                     {str(f2['rank']): c2 for f2, c2 in copies}, RULES["host_device_copy"].fix,
                     ranks=[f["rank"]] if status != OK else ())]


def storage(facts: list[dict[str, Any]], shared: dict[str, Any]) -> list[Finding]:
    names = node_names(facts)
    out = []
    free_t = RULES["disk_space"].thresholds["free_gb"]
    by_node = {}
    for f in facts:
        for p in f.get("paths", []):
            by_node[(names[f["node_id"]], p["role"], p["path"])] = p
    for (host, role, path), p in sorted(by_node.items()):
        free = p.get("free_bytes")
        if free is None:
            continue
        status = free_t.status(free / 2**30)
        out.append(finding("disk_space", status, f"{free / 2**30:.1f} GiB free at {role} path {path} on {host}"
                            + (f" (write speed {p['write_bytes_per_s'] / 2**20:.0f} MiB/s)" if p.get("write_bytes_per_s") else ""),
                            {"free_gb": round(free / 2**30, 2), "write_bytes_per_s": p.get("write_bytes_per_s")},
                            RULES["disk_space"].fix.format(path=path), hosts=[host] if status != OK else ()))
    rule = RULES["shared_paths"]
    for entry in shared.get("paths", []):
        if entry.get("why"):
            out.append(finding("shared_paths", NOT_MEASURED, f"{entry['role']} path {entry['path']}: {entry['why']}"))
        elif entry["not_shared_with"]:
            out.append(finding("shared_paths", rule.severities[entry["role"]].status,
                                f"{entry['role']} path {entry['path']} written on {entry['writer']} is not visible on "
                                f"{', '.join(entry['not_shared_with'])}", entry, rule.fix,
                                hosts=entry["not_shared_with"]))
        else:
            out.append(finding("shared_paths", OK, f"{entry['role']} path {entry['path']} is shared by all "
                                f"{len(entry['shared_with']) + 1} node(s)" if entry["shared_with"] else
                                f"{entry['role']} path {entry['path']}: one node, nothing to share", entry))
    return out or [finding("disk_space", NOT_MEASURED, "no path to check")]
