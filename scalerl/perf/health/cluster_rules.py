"""Rules on what `scalerl doctor --distributed-check` measures: every rank's facts (versions, devices,
interfaces, paths) and the cluster-wide measurements (rendezvous, all-reduce sweeps, node pairs, shared
paths, Ray placement groups). Plain dicts in, findings out: tests feed recorded measurements.

A rank's facts (`scalerl.doctor.facts` collects them): ``rank``, ``hostname``, ``node_id`` (one per
machine and network namespace), ``node_rank``, ``local_world_size``, ``versions`` {python, torch, cuda,
nccl, gpu_driver, scalerl}, ``device``, ``gpus`` [{name, memory_gb, free_gb}], ``memory`` {total_gb,
available_gb}, ``socket`` {variable, value, missing, interface, kind, virtual_kind, link_local},
``paths`` [{role, path, free_bytes}], ``copy`` {h2d_bytes_per_s, d2h_bytes_per_s} on GPUs.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from scalerl.perf.health.thresholds import RULES
from scalerl.perf.health.tree import FAULT, NOT_MEASURED, OK, WARNING, Finding, worst

VERSION_KEYS = ("torch", "cuda", "nccl", "scalerl", "python", "gpu_driver")
PACKAGES = {"torch": "torch", "scalerl": "scalerl", "python": "python", "cuda": "torch (its CUDA build)",
            "nccl": "torch (its bundled NCCL)", "gpu_driver": "nvidia-driver"}


def _finding(rule_id: str, status: str, summary: str, evidence: dict | None = None, fix: str = "",
             ranks=(), hosts=()) -> Finding:
    return Finding(RULES[rule_id].leaf, rule_id, status, summary, evidence or {},
                   fix if status in (WARNING, FAULT) else "", tuple(sorted(set(ranks))), tuple(dict.fromkeys(hosts)))


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


# ----------------------------------------------------------------------------------------- communication
def library_versions(facts: list[dict[str, Any]]) -> list[Finding]:
    rule = RULES["library_versions"]
    names = node_names(facts)
    out = []
    for key in VERSION_KEYS:
        seen: dict[str, list[dict]] = defaultdict(list)
        for f in facts:
            seen[str(f["versions"].get(key))].append(f)
        if len(seen) < 2:
            continue
        majority = max(seen, key=lambda v: len(seen[v]))
        odd = [f for v, group in seen.items() if v != majority for f in group]
        evidence = {"versions": {v: sorted(f["rank"] for f in group) for v, group in seen.items()}}
        hosts = [names[f["node_id"]] for f in odd]
        out.append(_finding("library_versions", rule.severities[key].status,
                            f"{key} differs across ranks: " + "; ".join(
                                f"{v} on rank(s) {_ranges(sorted(f['rank'] for f in group))}" for v, group in seen.items()),
                            evidence, rule.fix.format(package=PACKAGES[key], majority=majority,
                                                      hosts=", ".join(dict.fromkeys(hosts))),
                            ranks=[f["rank"] for f in odd], hosts=hosts))
    if not out:
        v = facts[0]["versions"]
        shown = ", ".join(f"{k} {v[k]}" for k in VERSION_KEYS if v.get(k))
        out.append(_finding("library_versions", OK, f"all {len(facts)} rank(s) run {shown}", {"versions": v}))
    return out


def socket_interfaces(facts: list[dict[str, Any]]) -> list[Finding]:
    rule = RULES["socket_interface"]
    names = node_names(facts)
    multi_node = len(names) > 1 or len({f["node_id"] for f in facts}) > 1
    out = []
    for f in facts:
        s = f.get("socket") or {}
        host = names[f["node_id"]]
        if s.get("missing"):
            out.append(_finding("socket_interface", rule.severities["missing"].status,
                                f"{s['variable']}={s['value']}: no interface {', '.join(s['missing'])} on {host} "
                                f"(rank {f['rank']}); it has {', '.join(s.get('available', [])) or 'none'}",
                                {"rank": f["rank"], "variable": s["variable"], "value": s["value"],
                                 "available": s.get("available", [])},
                                rule.fix.format(variable=s["variable"], suggestion=s.get("suggestion") or "<interface>"),
                                ranks=[f["rank"]], hosts=[host]))
    if out:
        return out
    if not multi_node:
        used = {(f.get("socket") or {}).get("interface") or "chosen by gloo/NCCL" for f in facts}
        return [_finding("socket_interface", OK, f"one node: collectives stay on this host (interface "
                         f"{', '.join(sorted(used))})")]
    for kind, test in (("link_local", lambda s: s.get("link_local")),
                       ("virtual", lambda s: s.get("kind") == "virtual")):
        bad = [f for f in facts if test(f.get("socket") or {})]
        if bad:
            s = bad[0]["socket"]
            what = "a link-local address" if kind == "link_local" else f"a {s.get('virtual_kind') or 'virtual'} interface"
            out.append(_finding("socket_interface", rule.severities[kind].status,
                                f"collectives between nodes go over {what} ({s.get('interface')}) on "
                                f"{', '.join(dict.fromkeys(names[f['node_id']] for f in bad))}",
                                {"interface": s.get("interface"), "ranks": [f["rank"] for f in bad]},
                                rule.fix.format(variable=s.get("variable") or "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME",
                                                suggestion=s.get("suggestion") or "<the NIC between nodes>"),
                                ranks=[f["rank"] for f in bad], hosts=[names[f["node_id"]] for f in bad]))
    if not out:
        used = sorted({(f.get("socket") or {}).get("interface") or "?" for f in facts})
        out.append(_finding("socket_interface", OK, f"collectives use {', '.join(used)} on every node"))
    return out


def rendezvous(measured: dict[str, Any]) -> list[Finding]:
    missing = measured.get("missing", [])
    if measured.get("world_size", 1) == 1:
        return [_finding("rendezvous", OK, "a single process: nothing to join")]
    if not missing:
        return [_finding("rendezvous", OK, f"all {measured.get('world_size', '?')} rank(s) joined within "
                         f"{measured.get('join_timeout_s', '?')} s", {"joined": measured.get("joined", [])})]
    ranks = [m["rank"] for m in missing]
    hosts = [m.get("expected_host", "?") for m in missing]
    where = "; ".join(f"rank {m['rank']} from {m.get('expected_host', '?')}" for m in missing)
    return [_finding("rendezvous", FAULT, f"{len(missing)} rank(s) did not join within {measured.get('join_timeout_s')} s: "
                     f"{where}", measured, RULES["rendezvous"].fix.format(
                         ranks=_ranges(ranks), hosts=", ".join(dict.fromkeys(hosts)), master=measured.get("master", "?")),
                     ranks=ranks, hosts=hosts)]


def rank_placement(facts: list[dict[str, Any]]) -> list[Finding]:
    rule = RULES["rank_placement"]
    placement = nodes(facts)
    out = []
    split = {host: ranks for host, ranks in placement.items() if ranks != list(range(ranks[0], ranks[0] + len(ranks)))}
    if split:
        out.append(_finding("rank_placement", rule.severities["not_contiguous"].status,
                            "ranks are not numbered node by node: " + "; ".join(
                                f"{h}: {_ranges(r)}" for h, r in placement.items()),
                            {"ranks_per_node": placement}, rule.fix, ranks=[r for rs in split.values() for r in rs],
                            hosts=list(split)))
    gpus = {host: len(next(f for f in facts if f["rank"] == ranks[0]).get("gpus", [])) for host, ranks in placement.items()}
    if len(set(gpus.values())) > 1:
        out.append(_finding("rank_placement", rule.severities["uneven_gpus"].status,
                            "GPUs per node differ: " + ", ".join(f"{h} {n}" for h, n in gpus.items()),
                            {"gpus_per_node": gpus}, rule.fix, hosts=list(gpus)))
    if not out:
        out.append(_finding("rank_placement", OK, f"{len(facts)} rank(s) on {len(placement)} node(s), numbered node "
                            "by node: " + "; ".join(f"{h}: {_ranges(r)}" for h, r in placement.items()),
                            {"ranks_per_node": placement}))
    return out


def ray_placement(measured: dict[str, Any]) -> list[Finding]:
    pending = measured.get("pending", [])
    if not pending:
        return [_finding("ray_placement", OK, f"no pending placement group among {measured.get('groups', 0)}")]
    out = []
    for group in pending:
        out.append(_finding("ray_placement", FAULT, f"placement group {group.get('name') or group['id'][:12]} is "
                            f"pending: {'; '.join(group['problems'])}", group,
                            group.get("fix") or "free the resources it waits for, or ask for fewer (smaller bundles, "
                                                "another strategy)"))
    return out


def allreduce_bandwidth(measured: dict[str, Any]) -> list[Finding]:
    threshold = RULES["allreduce_bandwidth"].thresholds["busbw_vs_nominal"]
    sweeps = measured.get("sweeps", [])
    if not sweeps:
        return [_finding("allreduce_bandwidth", NOT_MEASURED, measured.get("why", "one rank: no all-reduce to "
                                                                            "measure"))]
    out = []
    nominal = measured.get("nominal") or {}
    for sweep in sweeps:
        largest = max(sweep["results"], key=lambda r: r["size"])
        text = (f"{sweep['scope']} all-reduce over {len(sweep['ranks'])} rank(s)"
                f"{' on ' + sweep['node'] if sweep.get('node') else ''}: busbw {largest['busbw'] / 1e9:.3f} GB/s at "
                f"{_size(largest['size'])}")
        evidence = {"scope": sweep["scope"], "ranks": sweep["ranks"], "results": sweep["results"]}
        if sweep["scope"] != "inter-node" or not nominal.get("bytes_per_s"):
            why = ("intra-node paths (shared memory, PCIe, NVLink) have no nominal speed read here"
                   if sweep["scope"] != "inter-node" else nominal.get("why", "no interface speed readable"))
            out.append(_finding("allreduce_bandwidth", OK, f"{text} ({why})", evidence))
            continue
        ratio = largest["busbw"] / nominal["bytes_per_s"]
        status = threshold.status(ratio)
        evidence.update(nominal=nominal, ratio=round(ratio, 3))
        out.append(_finding("allreduce_bandwidth", status, f"{text}, {ratio:.0%} of {nominal['interface']}'s nominal "
                            f"{nominal['bytes_per_s'] * 8 / 1e9:g} Gbit/s", evidence,
                            RULES["allreduce_bandwidth"].fix.format(interface=nominal["interface"]),
                            hosts=[nominal.get("host", "")] if status != OK and nominal.get("host") else ()))
    return out


def link_pairs(measured: dict[str, Any]) -> list[Finding]:
    threshold = RULES["link_pairs"].thresholds["pair_vs_best"]
    pairs = measured.get("pairs", [])
    if len(pairs) < 2:
        why = "fewer than three nodes: no pair to compare with another" if pairs or measured.get("nodes", 1) > 1 \
            else "one node: no link between nodes"
        return [_finding("link_pairs", NOT_MEASURED if not pairs else OK,
                         why if not pairs else f"one pair of nodes: {_pair_text(pairs[0])} ({why})",
                         {"pairs": pairs})]
    best = max(p["bytes_per_s"] for p in pairs)
    graded = [(p, threshold.status(p["bytes_per_s"] / best)) for p in pairs]
    slow = [(p, s) for p, s in graded if s != OK]
    evidence = {"pairs": pairs, "best_bytes_per_s": best}
    if not slow:
        return [_finding("link_pairs", OK, f"{len(pairs)} node pairs within {threshold.warning:.0%} of the best "
                         f"({best / 1e6:.1f} MB/s)", evidence)]
    fast_nodes = {n for p, s in graded if s == OK for n in (p["a"], p["b"])}
    counts = Counter(n for p, _ in slow for n in (p["a"], p["b"]))
    # A node in every slow pair and in no fast one: its own link is the slow one.
    culprits = [n for n, c in counts.items() if c == len(slow) and n not in fast_nodes]
    status = worst(s for _, s in slow)
    names = culprits or list(dict.fromkeys(n for p, _ in slow for n in (p["a"], p["b"])))
    subject = f"the link of {' and '.join(culprits)}" if culprits else "the link between " + \
        ", ".join(f"{p['a']} and {p['b']}" for p, _ in slow)
    return [_finding("link_pairs", status, f"{subject} is slow: " + "; ".join(_pair_text(p) for p, _ in slow) +
                     f" vs the best pair's {best / 1e6:.1f} MB/s", evidence,
                     RULES["link_pairs"].fix.format(hosts=", ".join(names)), hosts=names)]


# ----------------------------------------------------------------------------------------- compute load
def device_models(facts: list[dict[str, Any]]) -> list[Finding]:
    models = {f["rank"]: (f.get("gpus") or [{"name": f.get("device", "cpu")}])[min(
        f.get("local_rank", 0), len(f.get("gpus") or [None]) - 1)]["name"] for f in facts}
    kinds = Counter(models.values())
    if len(kinds) < 2:
        return [_finding("device_models", OK, f"every rank runs on {next(iter(kinds))}; per-rank speed is "
                         "measured by --performance-profiling")]
    majority = kinds.most_common(1)[0][0]
    odd = [r for r, m in models.items() if m != majority]
    return [_finding("device_models", RULES["device_models"].severities["mixed"].status,
                     "device models differ: " + "; ".join(f"{m} on rank(s) {_ranges(sorted(r for r in models if models[r] == m))}"
                                                          for m in kinds), {"models": models},
                     RULES["device_models"].fix, ranks=odd)]


# ----------------------------------------------------------------------------------------- resources
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
        return [_finding("device_memory_free", NOT_MEASURED, "no device memory readable")]
    f, free, total, what, threshold = min(rows, key=lambda r: r[1] / r[2] if r[2] else 1.0)
    frac = free / total if total else 1.0
    status = threshold.status(frac)
    return [_finding("device_memory_free", status, f"least free: {free:.1f} of {total:.1f} GiB {what} on "
                     f"{names[f['node_id']]} (rank {f['rank']}) before the run", {"free_gb": round(free, 2),
                                                                                 "total_gb": round(total, 2)},
                     RULES["device_memory_free"].fix, ranks=[f["rank"]] if status != OK else (),
                     hosts=[names[f["node_id"]]] if status != OK else ())]


def host_device_copy(facts: list[dict[str, Any]]) -> list[Finding]:
    copies = [(f, f["copy"]) for f in facts if f.get("copy")]
    if not copies:
        return [_finding("host_device_copy", NOT_MEASURED, "no GPU on any rank: no host-device link to measure")]
    threshold = RULES["host_device_copy"].thresholds["gbytes_per_s"]
    f, c = min(copies, key=lambda fc: min(fc[1]["h2d_bytes_per_s"], fc[1]["d2h_bytes_per_s"]))
    slowest = min(c["h2d_bytes_per_s"], c["d2h_bytes_per_s"]) / 1e9
    status = threshold.status(slowest)
    return [_finding("host_device_copy", status, f"slowest pinned copy {slowest:.1f} GB/s (rank {f['rank']}: "
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
        out.append(_finding("disk_space", status, f"{free / 2**30:.1f} GiB free at {role} path {path} on {host}"
                            + (f" (write speed {p['write_bytes_per_s'] / 2**20:.0f} MiB/s)" if p.get("write_bytes_per_s") else ""),
                            {"free_gb": round(free / 2**30, 2), "write_bytes_per_s": p.get("write_bytes_per_s")},
                            RULES["disk_space"].fix.format(path=path), hosts=[host] if status != OK else ()))
    rule = RULES["shared_paths"]
    for entry in shared.get("paths", []):
        if entry.get("why"):
            out.append(_finding("shared_paths", NOT_MEASURED, f"{entry['role']} path {entry['path']}: {entry['why']}"))
        elif entry["not_shared_with"]:
            out.append(_finding("shared_paths", rule.severities[entry["role"]].status,
                                f"{entry['role']} path {entry['path']} written on {entry['writer']} is not visible on "
                                f"{', '.join(entry['not_shared_with'])}", entry, rule.fix,
                                hosts=entry["not_shared_with"]))
        else:
            out.append(_finding("shared_paths", OK, f"{entry['role']} path {entry['path']} is shared by all "
                                f"{len(entry['shared_with']) + 1} node(s)" if entry["shared_with"] else
                                f"{entry['role']} path {entry['path']}: one node, nothing to share", entry))
    return out or [_finding("disk_space", NOT_MEASURED, "no path to check")]


# ----------------------------------------------------------------------------------------- helpers
def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        start = rank if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n < 2**30 else f"{n / 2**30:g} GiB"


def _pair_text(p: dict[str, Any]) -> str:
    return f"{p['a']} <-> {p['b']} {p['bytes_per_s'] / 1e6:.1f} MB/s"


def run_cluster_rules(facts: list[dict[str, Any]], measured: dict[str, Any]) -> list[Finding]:
    """Every distributed-check rule over the ranks' ``facts`` and the cluster ``measured`` (keys
    ``rendezvous``, ``bandwidth``, ``shared``, ``ray``; an absent key leaves its rule out)."""
    findings = library_versions(facts) + socket_interfaces(facts) + rank_placement(facts)
    findings += device_models(facts) + device_memory(facts) + host_device_copy(facts)
    if "rendezvous" in measured:
        findings += rendezvous(measured["rendezvous"])
    if "bandwidth" in measured:
        findings += allreduce_bandwidth(measured["bandwidth"]) + link_pairs(measured["bandwidth"])
    if "ray" in measured:
        findings += ray_placement(measured["ray"])
    findings += storage(facts, measured.get("shared", {}))
    return findings
