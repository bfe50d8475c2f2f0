"""Rules on what `scalerl doctor --distributed-check` measures: every rank's facts (versions, devices,
interfaces, paths) and the cluster-wide measurements (rendezvous, all-reduce sweeps, node pairs, shared
paths, Ray placement groups). Plain dicts in, findings out: tests feed recorded measurements.

A rank's facts (`scalerl.doctor.facts` collects them): ``rank``, ``hostname``, ``node_id`` (one per
machine and network namespace), ``node_rank``, ``local_world_size``, ``versions`` {python, torch, cuda,
nccl, gpu_driver, scalerl}, ``device``, ``gpus`` [{name, memory_gb, free_gb}], ``memory`` {total_gb,
available_gb}, ``socket`` {variable, value, missing, interface, kind, virtual_kind, link_local},
``paths`` [{role, path, free_bytes}], ``copy`` {h2d_bytes_per_s, d2h_bytes_per_s} on GPUs, ``cpu``
(`CpuCapabilities.as_dict()`) and each GPU's ``capability`` and ``bf16``, which `hardware_rules` judges
against the config's precisions.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from scalerl.health.hardware_rules import run_hardware_rules
from scalerl.health.node_rules import (
    device_memory,
    device_models,
    host_device_copy,
    node_names,
    nodes,
    storage,
)
from scalerl.health.thresholds import RULES
from scalerl.health.tree import FAULT, NOT_MEASURED, OK, Finding, worst
from scalerl.health.wording import finding, ranges, rate, size_text

VERSION_KEYS = ("torch", "cuda", "nccl", "scalerl", "python", "gpu_driver", "vllm")
PACKAGES = {"torch": "torch", "scalerl": "scalerl", "python": "python", "cuda": "torch (its CUDA build)",
            "nccl": "torch (its bundled NCCL)", "gpu_driver": "nvidia-driver", "vllm": "vllm"}


def pair_text(p: dict[str, Any]) -> str:
    return f"{p['a']} <-> {p['b']} {rate(p['bytes_per_s'])}"


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
        out.append(finding("library_versions", rule.severities[key].status,
                            f"{key} differs across ranks: " + "; ".join(
                                f"{v} on rank(s) {ranges(sorted(f['rank'] for f in group))}" for v, group in seen.items()),
                            evidence, rule.fix.format(package=PACKAGES[key], majority=majority,
                                                      hosts=", ".join(dict.fromkeys(hosts))),
                            ranks=[f["rank"] for f in odd], hosts=hosts))
    if not out:
        v = facts[0]["versions"]
        shown = ", ".join(f"{k} {v[k]}" for k in VERSION_KEYS if v.get(k))
        out.append(finding("library_versions", OK, f"all {len(facts)} rank(s) run {shown}", {"versions": v}))
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
            out.append(finding("socket_interface", rule.severities["missing"].status,
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
        return [finding("socket_interface", OK, f"one node: collectives stay on this host (interface "
                         f"{', '.join(sorted(used))})")]
    for kind, test in (("link_local", lambda s: s.get("link_local")),
                       ("virtual", lambda s: s.get("kind") == "virtual")):
        bad = [f for f in facts if test(f.get("socket") or {})]
        if bad:
            s = bad[0]["socket"]
            what = "a link-local address" if kind == "link_local" else f"a {s.get('virtual_kind') or 'virtual'} interface"
            out.append(finding("socket_interface", rule.severities[kind].status,
                                f"collectives between nodes go over {what} ({s.get('interface')}) on "
                                f"{', '.join(dict.fromkeys(names[f['node_id']] for f in bad))}",
                                {"interface": s.get("interface"), "ranks": [f["rank"] for f in bad]},
                                rule.fix.format(variable=s.get("variable") or "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME",
                                                suggestion=s.get("suggestion") or "<the NIC between nodes>"),
                                ranks=[f["rank"] for f in bad], hosts=[names[f["node_id"]] for f in bad]))
    if not out:
        used = sorted({(f.get("socket") or {}).get("interface") or "?" for f in facts})
        out.append(finding("socket_interface", OK, f"collectives use {', '.join(used)} on every node"))
    return out


def rendezvous(measured: dict[str, Any]) -> list[Finding]:
    missing = measured.get("missing", [])
    if measured.get("world_size", 1) == 1:
        return [finding("rendezvous", OK, "a single process: nothing to join")]
    if not missing:
        return [finding("rendezvous", OK, f"all {measured.get('world_size', '?')} rank(s) joined within "
                         f"{measured.get('join_timeout_s', '?')} s", {"joined": measured.get("joined", [])})]
    ranks = [m["rank"] for m in missing]
    hosts = [m.get("expected_host", "?") for m in missing]
    where = "; ".join(f"rank {m['rank']} from {m.get('expected_host', '?')}" for m in missing)
    return [finding("rendezvous", FAULT, f"{len(missing)} rank(s) did not join within {measured.get('join_timeout_s')} s: "
                     f"{where}", measured, RULES["rendezvous"].fix.format(
                         ranks=ranges(ranks), hosts=", ".join(dict.fromkeys(hosts)), master=measured.get("master", "?")),
                     ranks=ranks, hosts=hosts)]


def rank_placement(facts: list[dict[str, Any]]) -> list[Finding]:
    rule = RULES["rank_placement"]
    placement = nodes(facts)
    out = []
    split = {host: ranks for host, ranks in placement.items() if ranks != list(range(ranks[0], ranks[0] + len(ranks)))}
    if split:
        out.append(finding("rank_placement", rule.severities["not_contiguous"].status,
                            "ranks are not numbered node by node: " + "; ".join(
                                f"{h}: {ranges(r)}" for h, r in placement.items()),
                            {"ranks_per_node": placement}, rule.fix, ranks=[r for rs in split.values() for r in rs],
                            hosts=list(split)))
    gpus = {host: len(next(f for f in facts if f["rank"] == ranks[0]).get("gpus", [])) for host, ranks in placement.items()}
    if len(set(gpus.values())) > 1:
        out.append(finding("rank_placement", rule.severities["uneven_gpus"].status,
                            "GPUs per node differ: " + ", ".join(f"{h} {n}" for h, n in gpus.items()),
                            {"gpus_per_node": gpus}, rule.fix, hosts=list(gpus)))
    if not out:
        out.append(finding("rank_placement", OK, f"{len(facts)} rank(s) on {len(placement)} node(s), numbered node "
                            "by node: " + "; ".join(f"{h}: {ranges(r)}" for h, r in placement.items()),
                            {"ranks_per_node": placement}))
    return out


def ray_placement(measured: dict[str, Any]) -> list[Finding]:
    pending = measured.get("pending", [])
    if not pending:
        return [finding("ray_placement", OK, f"no pending placement group among {measured.get('groups', 0)}")]
    out = []
    for group in pending:
        out.append(finding("ray_placement", FAULT, f"placement group {group.get('name') or group['id'][:12]} is "
                            f"pending: {'; '.join(group['problems'])}", group,
                            group.get("fix") or "free the resources it waits for, or ask for fewer (smaller bundles, "
                                                "another strategy)"))
    return out


def allreduce_bandwidth(measured: dict[str, Any]) -> list[Finding]:
    threshold = RULES["allreduce_bandwidth"].thresholds["busbw_vs_nominal"]
    sweeps = measured.get("sweeps", [])
    if not sweeps:
        return [finding("allreduce_bandwidth", NOT_MEASURED, measured.get("why", "one rank: no all-reduce to "
                                                                            "measure"))]
    out = []
    nominal = measured.get("nominal") or {}
    for sweep in sweeps:
        largest = max(sweep["results"], key=lambda r: r["size"])
        text = (f"{sweep['scope']} all-reduce over {len(sweep['ranks'])} rank(s)"
                f"{' on ' + sweep['node'] if sweep.get('node') else ''}: busbw {rate(largest['busbw'])} at "
                f"{size_text(largest['size'])}")
        evidence = {"scope": sweep["scope"], "ranks": sweep["ranks"], "results": sweep["results"]}
        if sweep["scope"] != "inter-node" or not nominal.get("bytes_per_s"):
            why = ("intra-node paths (shared memory, PCIe, NVLink) have no nominal speed read here"
                   if sweep["scope"] != "inter-node" else nominal.get("why", "no interface speed readable"))
            out.append(finding("allreduce_bandwidth", OK, f"{text} ({why})", evidence))
            continue
        ratio = largest["busbw"] / nominal["bytes_per_s"]
        status = threshold.status(ratio)
        evidence.update(nominal=nominal, ratio=round(ratio, 3))
        out.append(finding("allreduce_bandwidth", status, f"{text}, {ratio:.0%} of {nominal['interface']}'s nominal "
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
        return [finding("link_pairs", NOT_MEASURED if not pairs else OK,
                         why if not pairs else f"one pair of nodes: {pair_text(pairs[0])} ({why})",
                         {"pairs": pairs})]
    best = max(p["bytes_per_s"] for p in pairs)
    graded = [(p, threshold.status(p["bytes_per_s"] / best)) for p in pairs]
    slow = [(p, s) for p, s in graded if s != OK]
    evidence = {"pairs": pairs, "best_bytes_per_s": best}
    if not slow:
        return [finding("link_pairs", OK, f"{len(pairs)} node pairs within {threshold.warning:.0%} of the best "
                         f"({rate(best)})", evidence)]
    fast_nodes = {n for p, s in graded if s == OK for n in (p["a"], p["b"])}
    counts = Counter(n for p, _ in slow for n in (p["a"], p["b"]))
    # A node in every slow pair and in no fast one: its own link is the slow one.
    culprits = [n for n, c in counts.items() if c == len(slow) and n not in fast_nodes]
    status = worst(s for _, s in slow)
    names = culprits or list(dict.fromkeys(n for p, _ in slow for n in (p["a"], p["b"])))
    subject = f"the link of {' and '.join(culprits)}" if culprits else "the link between " + \
        ", ".join(f"{p['a']} and {p['b']}" for p, _ in slow)
    return [finding("link_pairs", status, f"{subject} is slow: " + "; ".join(pair_text(p) for p, _ in slow) +
                     f" vs the best pair's {rate(best)}", evidence,
                     RULES["link_pairs"].fix.format(hosts=", ".join(names)), hosts=names)]


def run_cluster_rules(facts: list[dict[str, Any]], measured: dict[str, Any],
                      settings: dict[str, str] | None = None) -> list[Finding]:
    """Every distributed-check rule over the ranks' ``facts`` and the cluster ``measured`` (keys
    ``rendezvous``, ``bandwidth``, ``shared``, ``ray``; an absent key leaves its rule out); ``settings``, the
    config's precisions (`hardware_rules.precision_settings`), are judged against each rank's hardware."""
    findings = library_versions(facts) + socket_interfaces(facts) + rank_placement(facts)
    findings += device_models(facts) + device_memory(facts) + host_device_copy(facts)
    findings += run_hardware_rules(facts, settings)
    if "rendezvous" in measured:
        findings += rendezvous(measured["rendezvous"])
    if "bandwidth" in measured:
        findings += allreduce_bandwidth(measured["bandwidth"]) + link_pairs(measured["bandwidth"])
    if "ray" in measured:
        findings += ray_placement(measured["ray"])
    findings += storage(facts, measured.get("shared", {}))
    return findings
