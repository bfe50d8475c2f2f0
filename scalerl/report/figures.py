"""The report's figures (matplotlib, drawn off-screen): each function takes the benchmark report (and the
projection) and returns a titled figure, or None when the report holds nothing to draw for it.

Titles are fixed strings (`TITLES`): the PDF and HTML checks look for them on the rendered pages.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

TITLES = {
    "throughput": "Throughput vs nodes (measured), with the ideal linear line",
    "efficiency": "Scaling efficiency vs nodes (measured)",
    "latency": "Latency per phase (measured, stacked)",
    "bytes": "Bytes on the wire per step, by kind (measured)",
    "memory": "Peak memory per rank (measured)",
    "validation": "Cost model: projected vs measured step and communication time",
    "projection": "Projected throughput vs nodes (cost model)",
    "baselines": "Baselines measured in the same run",
    "mfu_waterfall": "MFU waterfall: from the peak to the achieved MFU (measured)",
}
PAGE = (11.0, 7.5)
PHASES = ("gen", "old_log_prob", "ref", "teacher", "update_critic", "update_actor", "update_weights", "data", "reward",
          "adv", "balance", "other")
KINDS = ("grad", "param", "tp", "pp", "weight_sync", "rollout", "rebalance", "metrics")


def _ok(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in report["cells"] if c.get("status") == "ok"]


def _figure(key: str) -> tuple[Figure, Any]:
    fig, ax = plt.subplots(figsize=PAGE)
    fig.suptitle(TITLES[key], fontsize=15, fontweight="bold")
    return fig, ax


def _curves(report: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Cells of one strategy and variant by node count, one curve per link rate; a one-node cell (no link)
    starts every rate's curve of its variant, and the calibration cell starts those without one when the
    variant runs one rank per node, colocated, uncompressed."""
    cells = _ok(report)
    calibration = next((c for c in cells if c.get("calibration")), None)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for c in cells:
        if not c.get("calibration"):
            key = (c["strategy"], c["ranks_per_node"], c["compression"], c["allreduce"], c["weight_sync"])
            groups.setdefault(key, []).append(c)
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (strategy, rpn, comp, kind, sync), members in groups.items():
        single = [c for c in members if c["nodes"] == 1]
        plain = rpn == 1 and (comp, kind, sync) == ("none", "default", "colocated")
        if not single and plain and calibration:
            single = [calibration]
        extra = "".join(f", {v}" for v in (comp, kind, sync) if v not in ("none", "default", "colocated"))
        rates = sorted({c["rate_mbit"] for c in members if c["nodes"] > 1}) or [0.0]
        for rate in rates:
            points = single + [c for c in members if c["nodes"] > 1 and c["rate_mbit"] == rate]
            label = f"{rpn}/node{extra}" + (f", {rate:g} Mbit/s" if rate else "")
            out[(strategy, label)] = sorted(points, key=lambda c: c["nodes"])
    return out


def throughput_figure(report: dict[str, Any]) -> Figure | None:
    curves = _curves(report)
    calibration = next((c for c in _ok(report) if c.get("calibration")), None)
    if not curves:
        return None
    fig, ax = _figure("throughput")
    max_devices = 1
    for (strategy, variant), cells in curves.items():
        xs = [c["nodes"] for c in cells]
        ax.plot(xs, [c["throughput"]["tokens_per_s"]["median"] for c in cells], marker="o",
                label=f"{strategy} ({variant})")
        max_devices = max(max_devices, max(c["devices"] for c in cells))
    if calibration:
        per_device = calibration["throughput"]["tokens_per_s"]["median"]
        nodes = sorted({c["nodes"] for cells in curves.values() for c in cells})
        rpn = max(c["ranks_per_node"] for cells in curves.values() for c in cells)
        ax.plot(nodes, [per_device * n * rpn for n in nodes], "k--", label="ideal (linear, from 1 rank)")
    ax.set_xlabel("nodes")
    ax.set_ylabel("tokens/s (median over steps)")
    ax.set_xticks(sorted({c["nodes"] for cells in curves.values() for c in cells}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def efficiency_figure(report: dict[str, Any]) -> Figure | None:
    curves = {k: [c for c in v if c.get("scaling_efficiency") is not None] for k, v in _curves(report).items()}
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    fig, ax = _figure("efficiency")
    for (strategy, variant), cells in curves.items():
        ax.plot([c["nodes"] for c in cells], [100 * c["scaling_efficiency"] for c in cells], marker="o",
                label=f"{strategy} ({variant})")
    ax.axhline(100, color="k", linestyle="--", linewidth=1, label="ideal")
    ax.set_xlabel("nodes")
    ax.set_ylabel("scaling efficiency % (tokens/s per device vs the one-node cell)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _labels(cells: list[dict[str, Any]]) -> list[str]:
    """strategy, nodes x ranks per node, the link and any axis off its default, one per line."""
    out = []
    for c in cells:
        parts = [c["strategy"], f"{c['nodes']}x{c['ranks_per_node']}"]
        parts += [f"{c['rate_mbit']:g} Mbit/s"] if c["nodes"] > 1 else []
        parts += [v for v in (c["compression"], c["allreduce"], c["weight_sync"]) if v not in ("none", "default",
                                                                                             "colocated")]
        out.append("\n".join(parts))
    return out


def _distinct(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured cells, each measurement once (a cell that reused another's identical run is left out)."""
    return [c for c in _ok(report) if not c.get("same_as")]


def latency_figure(report: dict[str, Any]) -> Figure | None:
    cells = _distinct(report)
    if not cells:
        return None
    fig, ax = _figure("latency")
    x = range(len(cells))
    bottom = [0.0] * len(cells)
    for phase in PHASES:
        values = [c["latency_ms"].get(phase, {}).get("median", 0.0) for c in cells]
        if any(values):
            ax.bar(x, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(list(x), [c["latency_ms"]["comm_exposed"]["median"] for c in cells], "kD", label="of which: waiting "
            "in collectives")
    ax.set_xticks(list(x))
    ax.set_xticklabels(_labels(cells), fontsize=7)
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=8, ncol=3)
    return fig


def bytes_figure(report: dict[str, Any]) -> Figure | None:
    cells = [c for c in _distinct(report) if c["bytes_per_step"].get("total", 0) > 0]
    if not cells:
        return None
    fig, ax = _figure("bytes")
    x = range(len(cells))
    bottom = [0.0] * len(cells)
    for kind in KINDS:
        values = [c["bytes_per_step"].get(kind, 0.0) / 1e6 for c in cells]
        if any(values):
            ax.bar(x, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(x))
    ax.set_xticklabels(_labels(cells), fontsize=7)
    ax.set_ylabel("MB each rank sends per step (mean over ranks)")
    ax.legend(fontsize=8)
    return fig


def memory_figure(report: dict[str, Any]) -> Figure | None:
    cells = _distinct(report)
    if not cells:
        return None
    fig, ax = _figure("memory")
    ax.bar(range(len(cells)), [c["memory"]["peak_gb"] for c in cells], color="tab:purple")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(_labels(cells), fontsize=7)
    ax.set_ylabel("GB (GPU: peak allocated; CPU: peak resident set, runtime included)")
    return fig


def validation_figure(report: dict[str, Any]) -> Figure | None:
    entries = report.get("validation") or []
    if not entries:
        return None
    fig, axes = plt.subplots(1, 2, figsize=PAGE)
    fig.suptitle(TITLES["validation"], fontsize=15, fontweight="bold")
    for ax, key, what in ((axes[0], "step_s", "step time"), (axes[1], "comm_s", "communication time (timed kinds)")):
        pairs = [(e["measured"][key] * 1e3, e["projected"][key] * 1e3, e["cell"]) for e in entries
                 if e["measured"][key] > 0]
        if not pairs:
            continue
        top = max(max(m, p) for m, p, _ in pairs) * 1.1
        ax.plot([0, top], [0, top], "k-", linewidth=1, label="projected = measured")
        ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="green", alpha=0.1, label="+-15%")
        ax.scatter([m for m, _, _ in pairs], [p for _, p, _ in pairs], zorder=3)
        for m, p, name in pairs:
            ax.annotate(name.split("|")[0] + " " + name.split("|")[1] + " " + name.split("|")[2], (m, p), fontsize=6)
        ax.set_xlabel(f"measured {what}, ms")
        ax.set_ylabel(f"projected {what}, ms")
        ax.legend(fontsize=8)
    return fig


def projection_figure(projection: dict[str, Any] | None) -> Figure | None:
    if not projection:
        return None
    rows = [r for r in projection["rows"] if "skipped" not in r]
    if not rows:
        return None
    fig, ax = _figure("projection")
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        ax.plot([r["nodes"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=strategy)
    nodes = sorted({r["nodes"] for r in rows})
    ax.plot(nodes, [projection["ideal_per_device"] * n * projection["devices_per_node"] for n in nodes], "k--",
            label="ideal (linear)")
    ax.set_title(f"PROJECTED: {projection['model']}, {projection['devices_per_node']} device(s)/node, "
                 f"link: {projection['calibration']['inter_link'][:70]}", fontsize=9)
    ax.set_xlabel("nodes")
    ax.set_ylabel("tokens/s (projected)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def baselines_figure(report: dict[str, Any]) -> Figure | None:
    base = report.get("baselines") or {}
    if not base.get("plain_update") and not base.get("generate"):
        return None
    fig, axes = plt.subplots(1, 2, figsize=PAGE)
    fig.suptitle(TITLES["baselines"], fontsize=15, fontweight="bold")
    if base.get("plain_update"):
        b = base["plain_update"]
        axes[0].bar(["plain PyTorch", "scalerl"], [b["plain_s"]["median"] * 1e3, b["scalerl_s"]["median"] * 1e3],
                    color=["tab:gray", "tab:blue"])
        axes[0].set_title(f"actor update, ms (ratio {b['ratio']:.2f}x, target >= 1.0x)")
    if base.get("generate"):
        g = base["generate"]
        axes[1].bar(["HF generate", "scalerl engine"], [g["hf_tokens_per_s"], g["scalerl_tokens_per_s"]],
                    color=["tab:gray", "tab:blue"])
        axes[1].set_title(f"rollout, tokens/s (ratio {g['ratio']:.2f}x)")
    return fig


WATERFALL_COLORS = {"peak": "tab:gray", "achieved": "tab:green", "eval": "tab:blue", "checkpoint": "tab:cyan",
                    "data": "tab:olive", "reward": "tab:brown", "weight_sync": "tab:pink", "comm": "tab:red",
                    "imbalance": "tab:purple", "bubble": "navy", "long_tail": "gold", "padding": "teal",
                    "compute": "tab:orange", "unattributed": "lightgray"}


def waterfall_cells(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured cells that carry an MFU waterfall (`scalerl.perf.mfu_waterfall`, from their steps)."""
    return [c for c in _distinct(report) if c.get("mfu_waterfall")]


def waterfall_cell(report: dict[str, Any]) -> dict[str, Any] | None:
    """The cell the waterfall page draws in full: the most devices, then the highest throughput."""
    cells = waterfall_cells(report)
    return max(cells, key=lambda c: (c["devices"], c["throughput"]["tokens_per_s"]["median"])) if cells else None


def mfu_waterfall_figure(report: dict[str, Any]) -> Figure | None:
    from scalerl.perf.mfu_waterfall import SLICES, MfuWaterfall

    cells, chosen = waterfall_cells(report), waterfall_cell(report)
    if chosen is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=PAGE, gridspec_kw={"width_ratios": [3, 2]})
    fig.suptitle(TITLES["mfu_waterfall"], fontsize=15, fontweight="bold")
    waterfall = MfuWaterfall.from_json(chosen["mfu_waterfall"])
    rows = waterfall.rows()
    colors = WATERFALL_COLORS
    for x, row in enumerate(rows):
        if row["key"] in ("peak", "achieved"):
            bottom, height = 0.0, 100 * row["points"]
        else:
            bottom, height = 100 * row["level"], 100 * row["points"]
        left.bar(x, height, bottom=bottom, color=colors[row["key"]])
        left.annotate(f"{100 * row['points']:.1f}", (x, bottom + max(height, 0.0)), ha="center", va="bottom",
                      fontsize=7)
    left.set_xticks(range(len(rows)))
    left.set_xticklabels([r["label"] for r in rows], rotation=35, ha="right", fontsize=6.5)
    left.set_ylabel("% of the device's peak (MFU points)")
    left.set_ylim(0, 108)
    left.set_title(f"{chosen['id']}: achieved {100 * waterfall.achieved_mfu:.2f}% of peak; slices cover "
                   f"{100 * waterfall.attributed_share:.1f}% of the step", fontsize=8)
    y = range(len(cells))
    start = [0.0] * len(cells)
    falls = [MfuWaterfall.from_json(c["mfu_waterfall"]) for c in cells]
    keyed = [("achieved", "achieved MFU")] + list(SLICES)
    for key, label in keyed:
        values = [100 * (w.achieved_mfu if key == "achieved" else w.points(key)) for w in falls]
        if any(v > 0.05 for v in values):
            right.barh(list(y), values, left=start, label=label, color=colors.get(key))
            start = [a + b for a, b in zip(start, values)]
    right.set_yticks(list(y))
    right.set_yticklabels([c["id"].split("|")[0] + " " + c["id"].split("|")[1] for c in cells], fontsize=7)
    right.set_xlabel("% of the peak (each bar sums to 100)")
    right.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def waterfall_text(report: dict[str, Any]) -> str:
    """Each cell's waterfall as text (the report's text section beside the figure)."""
    from scalerl.perf.mfu_waterfall import MfuWaterfall

    out = []
    for cell in waterfall_cells(report):
        waterfall = MfuWaterfall.from_json(cell["mfu_waterfall"])
        out.append(f"{cell['id']}: achieved MFU {100 * waterfall.achieved_mfu:.2f}% of the peak over "
                   f"{waterfall.whole_s:.4f} s per step")
        out += waterfall.lines()
        out += [f"  problem: {p}" for p in waterfall.check()] + [""]
    return "\n".join(out)


def all_figures(report: dict[str, Any], projection: dict[str, Any] | None) -> list[tuple[str, Figure]]:
    """Every figure the report can draw, in page order, with its key."""
    makers = (("throughput", throughput_figure), ("efficiency", efficiency_figure), ("latency", latency_figure),
              ("bytes", bytes_figure), ("memory", memory_figure), ("mfu_waterfall", mfu_waterfall_figure),
              ("baselines", baselines_figure),
              ("validation", validation_figure))
    out = [(key, fig) for key, make in makers if (fig := make(report)) is not None]
    fig = projection_figure(projection)
    if fig is not None:
        out.append(("projection", fig))
    return out
