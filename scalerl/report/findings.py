"""The first page: headline findings read off the measurements, and a recommended configuration for the
target cluster (strategy, gradient compression, weight-sync mode), each choice with the numbers behind it.

Strategy: the highest projected tokens/s at the target's node count among the layouts that fit the
device's memory (the cost model, calibrated on this report). Compression and weight sync: what this
report measured (cells with and without), or, when it did not measure them, what the projection's
communication share suggests and the bench command that would measure it.
"""

from __future__ import annotations

from typing import Any

COMM_SHARE_FOR_COMPRESSION = 0.3  # above this share of the step in communication, fewer bytes pay off


def _ok(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in report["cells"] if c.get("status") == "ok"]


def _tps(cell: dict[str, Any]) -> float:
    return cell["throughput"]["tokens_per_s"]["median"]


def headlines(report: dict[str, Any]) -> list[str]:
    cells = [c for c in _ok(report) if not c.get("calibration")]
    out = []
    if cells:
        top_nodes = max(c["nodes"] for c in cells)
        at_top = [c for c in cells if c["nodes"] == top_nodes]
        best = max(at_top, key=_tps)
        eff = best.get("scaling_efficiency")
        out.append(f"Fastest at {top_nodes} node(s): {best['id']} at {_tps(best):,.0f} tokens/s"
                   + (f", {100 * eff:.0f}% scaling efficiency" if eff is not None else "") + " (measured).")
        for c in sorted(at_top, key=_tps)[:1]:
            if c is not best:
                share = c["latency_ms"]["comm_exposed"]["median"] / c["latency_ms"]["step"]["median"]
                top_kind = max(c["bytes_per_step"], key=lambda k: c["bytes_per_step"][k] if k != "total" else -1)
                out.append(f"Slowest at {top_nodes} node(s): {c['id']} at {_tps(c):,.0f} tokens/s; {100 * share:.0f}% "
                           f"of its step waits in collectives, most bytes are '{top_kind}' "
                           f"({c['bytes_per_step'][top_kind] / 1e6:.1f} MB per step per rank).")
    base = report.get("baselines") or {}
    if base.get("plain_update"):
        b = base["plain_update"]
        out.append(f"Framework overhead: a plain PyTorch update of the same batches takes {b['ratio']:.2f}x scalerl's "
                   f"update time (target >= 1.0x: {'met' if b['meets_target'] else 'not met'}).")
    if base.get("generate"):
        g = base["generate"]
        out.append(f"Rollout: the built-in engine generates {g['ratio']:.2f}x HF generate's tokens/s on the same "
                   f"weights and prompts ({g['scalerl_tokens_per_s']:,.0f} vs {g['hf_tokens_per_s']:,.0f}).")
    summary = (report.get("calibration") or {}).get("validation_summary") or {}
    if summary.get("step"):
        s = summary["step"]
        comm = summary.get("comm")
        out.append(f"Cost model vs measured on {s['cells']} cells: step time |error| median {100 * s['median']:.1f}%, "
                   f"max {100 * s['max']:.1f}%" + (f"; communication median {100 * comm['median']:.1f}%, max "
                                                     f"{100 * comm['max']:.1f}%" if comm else "")
                   + f" (target <= {100 * summary['target']:.0f}%).")
    failed = [c for c in report["cells"] if c.get("status") == "failed"]
    skipped = [c for c in report["cells"] if c.get("status") == "skipped"]
    if failed or skipped:
        out.append(f"{len(failed)} cell(s) failed and {len(skipped)} were skipped (reasons in the appendix).")
    return out


def _measured_pair(report: dict[str, Any], axis: str, plain: str, tried: set[str] | None = None
                   ) -> tuple[dict, dict] | None:
    """A cell whose ``axis`` took a value in ``tried`` (default: anything but ``plain``) and its twin with
    ``plain`` (same strategy, nodes, rate and other axes), both measured; the largest node count first, then
    the largest gain."""
    cells = _ok(report)
    others = [c for c in cells if c[axis] != plain and (tried is None or c[axis] in tried)]
    pairs = []
    for c in others:
        twin = next((t for t in cells if t[axis] == plain and all(t[k] == c[k] for k in
                    ("strategy", "nodes", "ranks_per_node", "rate_mbit")) and
                     all(t[k] == c[k] for k in ("compression", "allreduce", "weight_sync") if k != axis)), None)
        if twin is not None:
            pairs.append((c, twin))
    if not pairs:
        return None
    return max(pairs, key=lambda p: (p[0]["nodes"], _tps(p[0]) / _tps(p[1])))


def recommend(report: dict[str, Any], projection: dict[str, Any] | None) -> dict[str, Any]:
    """The recommended configuration for the projection's target cluster, with its reasoning."""
    reasons: list[str] = []
    choice: dict[str, Any] = {"strategy": None, "compression": "none", "weight_sync": "auto"}
    rows = [r for r in (projection or {}).get("rows", []) if "skipped" not in r]
    if rows:
        top = max(r["nodes"] for r in rows)
        candidates = [r for r in rows if r["nodes"] == top and r.get("fits", True)]
        if candidates:
            best = max(candidates, key=lambda r: r["tokens_per_s"])
            runner = sorted(candidates, key=lambda r: -r["tokens_per_s"])[1:2]
            choice["strategy"] = best["strategy"]
            choice["parallel"] = best["layout"]
            reasons.append(
                f"Strategy {best['strategy']} ({', '.join(f'{k}={v}' for k, v in best['layout'].items() if v > 1) or 'one rank'}): "
                f"projected {best['tokens_per_s']:,.0f} tokens/s at {top} node(s), {100 * best['scaling_efficiency']:.0f}% "
                f"scaling efficiency, {100 * best['comm_share']:.0f}% of the step in communication, "
                f"{best['memory_gb']:.3g} GB per device"
                + (f"; next best {runner[0]['strategy']} at {runner[0]['tokens_per_s']:,.0f} tokens/s." if runner else "."))
            too_big = [r["strategy"] for r in rows if r["nodes"] == top and r.get("fits") is False]
            if too_big:
                reasons.append(f"Left out for memory: {', '.join(too_big)} (projected above the device's memory).")
            comm_share = best["comm_share"]
        else:
            comm_share = None
            reasons.append("No projected layout fits the device's memory at the target size: more devices, "
                           "activation checkpointing (model.activation_checkpointing=true) or a smaller model.")
    else:
        comm_share = None
        reasons.append("No projection for a target cluster: run `scalerl report` with --nodes/--link, or "
                       "`scalerl bench --project`.")
    pair = _measured_pair(report, "compression", "none")
    if pair:
        comp, plain = pair
        gain = _tps(comp) / _tps(plain)
        if gain > 1.03:
            choice["compression"] = comp["compression"]
        reasons.append(f"Compression: measured {comp['compression']} at {comp['nodes']} node(s) "
                       f"{gain:.2f}x the uncompressed throughput ({comp['bytes_per_step']['grad'] / 1e6:.1f} vs "
                       f"{plain['bytes_per_step']['grad'] / 1e6:.1f} MB of gradients per step) -> "
                       f"comm.gradient_compression={choice['compression']}.")
    elif comm_share is not None:
        word = "worth measuring" if comm_share > COMM_SHARE_FOR_COMPRESSION else "unlikely to pay"
        reasons.append(f"Compression: not measured in this report; the projected step spends {100 * comm_share:.0f}% "
                       f"in communication, so it is {word} (scalerl bench --compression none,fp16,powersgd).")
    pair = _measured_pair(report, "weight_sync", "full", {"delta", "auto"})
    if pair:
        mode, full = pair
        name = mode["weight_sync"]
        fraction = mode.get("weight_sync_fraction")
        better = _tps(mode) >= _tps(full)
        choice["weight_sync"] = name if better else "full"
        reasons.append(f"Weight sync: {name} sent {100 * fraction:.1f}% of a full push's bytes per sync"
                       if fraction is not None else f"Weight sync: {name} and full measured")
        reasons[-1] += f", throughput {_tps(mode) / _tps(full):.2f}x full's -> weight_sync.mode={choice['weight_sync']}."
    else:
        choice["weight_sync"] = "auto"
        reasons.append("Weight sync: only colocated rollouts were measured here (no sync over the network); with "
                       "standalone rollout workers use weight_sync.mode=auto (per sync, lossless deltas or dense "
                       "buckets, whichever has cost less time: deltas over slow links, dense next to the trainer) "
                       "and measure it with scalerl bench --weight-sync full,delta,auto.")
    return {**choice, "reasoning": reasons}
