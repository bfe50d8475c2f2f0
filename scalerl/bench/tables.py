"""Plain-text tables of a report (measured) and of a projection (projected), kept apart and labelled: what
`scalerl bench` prints and docs/bench.md shows."""

from __future__ import annotations

from typing import Any


def _fmt_rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _fmt_bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in
                                   enumerate(zip(cells, widths)))
    return "\n".join([line(header)] + [line(r) for r in rows])


def measured_tables(report: dict[str, Any]) -> str:
    cells = [c for c in report["cells"] if c.get("status") == "ok"]
    env = report["environment"]
    out = [(f"MEASURED on {env.get('hostname')} ({env.get('cpu_model')}, {env.get('cores')} cores), commit "
            f"{(env.get('git_commit') or '?')[:10]}{' (dirty)' if env.get('git_dirty') else ''}, load average "
            f"{env.get('load_average_before', [0])[0]:.1f} before / {env.get('load_average_after', [0])[0]:.1f} "
            f"after; {report['config'].get('steps')} measured steps per cell after {report['config'].get('warmup')} "
            "warm-up, medians")]
    calibration = next((c for c in cells if c.get("calibration")), None)
    per_device = calibration["throughput"]["tokens_per_s"]["median"] if calibration else None
    strategies = list(dict.fromkeys(c["strategy"] for c in cells if not c.get("calibration")))
    variants = list(dict.fromkeys(_variant(c) for c in cells if not c.get("calibration")))
    for variant in variants:
        chosen = [c for c in cells if _variant(c) == variant and not c.get("calibration")]
        nodes = sorted({c["nodes"] for c in chosen})
        header = ["nodes", "devices", "ideal (linear)"] + strategies
        rows = []
        for n in nodes:
            row_cells = {c["strategy"]: c for c in chosen if c["nodes"] == n}
            devices = next(iter(row_cells.values()))["devices"]
            row = [str(n), str(devices), _fmt_rate(per_device * devices) if per_device else "-"]
            for s in strategies:
                c = row_cells.get(s)
                eff = c.get("scaling_efficiency") if c else None
                row.append("-" if c is None else _fmt_rate(c["throughput"]["tokens_per_s"]["median"]) +
                           (f" ({100 * eff:.0f}%)" if eff is not None else ""))
            rows.append(row)
        out += ["", f"tokens/s by nodes x strategy (scaling efficiency), {variant}", _grid(header, rows)]
    header = ["cell", "ms/step", "+-IQR", "gen", "update", "w.sync", "comm exp.", "other", "MFU", "CPU/rank",
              "peak GB", "bytes/step", "MB/s"]
    rows = []
    for c in cells:
        lat = c["latency_ms"]

        def get(k: str, lat: dict = lat) -> str:
            return f"{lat[k]['median']:.0f}" if k in lat else "-"

        mfu = c.get("mfu", {}).get("step", {}).get("median")
        rows.append([c["id"], f"{lat['step']['median']:.0f}", f"{100 * lat['step']['rel_iqr']:.0f}%", get("gen"),
                     get("update_actor"), get("update_weights"), get("comm_exposed"), get("other"),
                     f"{100 * mfu:.1f}%" if mfu else "-", f"{c['cpu'].get('utilization_per_rank', 0):.2f}",
                     f"{c['memory']['peak_gb']:.2f}", _fmt_bytes(c["bytes_per_step"]["total"]),
                     f"{c['bytes_per_s']['total'] / 1e6:.1f}"])
    out += ["", "latency per phase (ms, median over steps, mean over ranks)", _grid(header, rows)]
    base = report.get("baselines", {})
    if base.get("plain_update"):
        b = base["plain_update"]
        out += ["", (f"baseline, plain PyTorch update: {b['plain_s']['median'] * 1e3:.1f} ms vs scalerl "
                     f"{b['scalerl_s']['median'] * 1e3:.1f} ms, ratio {b['ratio']:.2f}x (target >= 1.0x: "
                     f"{'met' if b['meets_target'] else 'NOT met'})")]
    if base.get("generate"):
        g = base["generate"]
        out.append(f"baseline, HF generate: {_fmt_rate(g['hf_tokens_per_s'])} tokens/s vs built-in engine "
                   f"{_fmt_rate(g['scalerl_tokens_per_s'])} tokens/s, ratio {g['ratio']:.2f}x")
    if report.get("validation"):
        out += ["", validation_table(report)]
    return "\n".join(out)


def _variant(cell: dict[str, Any]) -> str:
    rate = "one node" if cell["nodes"] == 1 else f"{cell['rate_mbit']:g} Mbit/s links"
    return (f"{cell['ranks_per_node']} rank(s)/node, compression {cell['compression']}, all-reduce "
            f"{cell['allreduce']}, rollout {cell['weight_sync']}, {rate}")


def validation_table(report: dict[str, Any]) -> str:
    header = ["cell", "contention", "step ms meas.", "proj.", "error", "comm ms meas.", "proj.", "error",
              "compute err.", "bytes err."]
    rows = []
    for v in report["validation"]:
        m, p, e = v["measured"], v["projected"], v["error"]
        rows.append([v["cell"], f"{v['contention']:.2f}", f"{m['step_s'] * 1e3:.0f}", f"{p['step_s'] * 1e3:.0f}",
                     _pct(e["step"]), f"{m['comm_s'] * 1e3:.0f}", f"{p['comm_s'] * 1e3:.0f}", _pct(e["comm"]),
                     _pct(e.get("compute")), _pct(e["bytes"])])
    summary = report.get("calibration", {}).get("validation_summary") or {}
    tail = []
    for key in ("step", "comm", "compute"):
        s = summary.get(key)
        if s:
            tail.append(f"{key} time |error| median {100 * s['median']:.1f}%, max {100 * s['max']:.1f}% "
                        f"over {s['cells']} cells")
    head = f"cost model vs measured (target |error| <= {100 * summary.get('target', 0.15):.0f}%)"
    return "\n".join([head, _grid(header, rows)] + (["; ".join(tail)] if tail else []))


def projected_tables(result: dict[str, Any]) -> str:
    cal = result["calibration"]
    rows_ok = [r for r in result["rows"] if "skipped" not in r]
    strategies = list(dict.fromkeys(r["strategy"] for r in result["rows"]))
    nodes = sorted({r["nodes"] for r in result["rows"]})
    by = {(r["strategy"], r["nodes"]): r for r in result["rows"]}
    step = result["step"]
    out = [(f"{result['label']}: model {result['model']}, {step['rows_per_rank']} sequences per DP rank per step, "
            f"prompt {step['prompt_len']:.0f} + response {step['response_len']:.0f} tokens, "
            f"{result['devices_per_node']} device(s) per node, device {result['device']}"),
           f"calibration: compute {cal['compute']}",
           f"             inter-node link {cal['inter_link']}", f"             intra-node link {cal['intra_link']}"]
    if cal.get("validation") and cal["validation"].get("step"):
        s = cal["validation"]["step"]
        out.append(f"             validated on {s['cells']} measured cells: step time |error| median "
                   f"{100 * s['median']:.1f}%, max {100 * s['max']:.1f}%")
    cell = lambda r, fn: "-" if r is None or "skipped" in r else fn(r)
    devices = {n: n * result["devices_per_node"] for n in nodes}
    header = ["nodes", "devices", "ideal (linear)"] + strategies
    table = [[str(n), str(devices[n]), _fmt_rate(result["ideal_per_device"] * devices[n])] +
             [cell(by.get((s, n)), lambda r: _fmt_rate(r["tokens_per_s"])) for s in strategies] for n in nodes]
    out += ["", "PROJECTED tokens/s by nodes x strategy", _grid(header, table)]
    table = [[str(n), str(devices[n])] + [cell(by.get((s, n)), lambda r: f"{r['step_s'] * 1e3:,.0f}")
                                          for s in strategies] for n in nodes]
    out += ["", "PROJECTED ms per batch (one step)", _grid(["nodes", "devices"] + strategies, table)]
    header = ["nodes", "strategy", "memory/device GB", "fits", "link GB/s per node", "link busy", "comm share",
              "scaling eff."]
    table = [[str(r["nodes"]), r["strategy"], f"{r['memory_gb']:.2f}", {True: "yes", False: "NO"}.get(r.get("fits"), "-"),
              f"{r['node_link_bytes_per_s'] / 1e9:.3f}", f"{100 * r['link_utilization']:.0f}%",
              f"{100 * r['comm_share']:.0f}%", f"{100 * r['scaling_efficiency']:.0f}%"] for r in rows_ok]
    out += ["", "PROJECTED per-node resources", _grid(header, table)]
    skipped = [f"{r['strategy']} at {r['nodes']} node(s): {r['skipped']}" for r in result["rows"] if "skipped" in r]
    if skipped:
        out += ["", "not projected: " + "; ".join(skipped)]
    return "\n".join(out)
