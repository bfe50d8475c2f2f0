"""`scalerl bench --compare A.json B.json`: the change of every cell both reports measured, against a noise
band, so a regression across commits stands out from the machine's jitter.

A cell's noise is its relative interquartile range over steps (``rel_iqr``). The band of a comparison is
``max(min_band, k x sqrt(noise_A^2 + noise_B^2))``: a change inside it is "within noise", outside it
"faster" / "slower" (for step time, lower is better; for tokens/s, higher).
"""

from __future__ import annotations

import math
from typing import Any

MIN_BAND = 0.03  # 3%: below this two runs of one commit differ anyway on a shared machine
NOISE_K = 1.0


def _metrics(cell: dict[str, Any]) -> dict[str, tuple[float, float, bool]]:
    """name -> (median, relative spread, higher is better)."""
    out = {"tokens/s": (cell["throughput"]["tokens_per_s"]["median"], cell["throughput"]["tokens_per_s"]["rel_iqr"],
                        True),
           "ms/step": (cell["latency_ms"]["step"]["median"], cell["latency_ms"]["step"]["rel_iqr"], False)}
    for phase in ("gen", "update_actor", "comm_exposed"):
        if phase in cell["latency_ms"] and cell["latency_ms"][phase]["median"] > 0:
            lat = cell["latency_ms"][phase]
            out[f"{phase} ms"] = (lat["median"], lat["rel_iqr"], False)
    return out


def compare_reports(a: dict[str, Any], b: dict[str, Any], min_band: float = MIN_BAND) -> list[dict[str, Any]]:
    """One row per (cell, metric) measured in both: values, change, band and verdict."""
    cells_a = {c["id"]: c for c in a["cells"] if c.get("status") == "ok"}
    rows = []
    for cell in b["cells"]:
        if cell.get("status") != "ok" or cell["id"] not in cells_a:
            continue
        old, new = _metrics(cells_a[cell["id"]]), _metrics(cell)
        for name in old.keys() & new.keys():
            (va, na, higher), (vb, nb, _) = old[name], new[name]
            if va <= 0:
                continue
            change = (vb - va) / va
            band = max(min_band, NOISE_K * math.hypot(na, nb))
            if abs(change) <= band:
                verdict = "within noise"
            else:
                better = change > 0 if higher else change < 0
                verdict = "better" if better else "WORSE"
            rows.append({"cell": cell["id"], "metric": name, "a": va, "b": vb, "change": change, "band": band,
                         "verdict": verdict})
    order = {"tokens/s": 0, "ms/step": 1}
    return sorted(rows, key=lambda r: (r["cell"], order.get(r["metric"], 2), r["metric"]))


def format_comparison(rows: list[dict[str, Any]], a_name: str, b_name: str, a: dict, b: dict) -> str:
    commit = lambda r: (r["environment"].get("git_commit") or "?")[:10]
    lines = [f"A = {a_name} (commit {commit(a)}, {a['created']})", f"B = {b_name} (commit {commit(b)}, {b['created']})"]
    if not rows:
        return "\n".join(lines + ["no cell was measured in both reports"])
    width = max(len(r["cell"]) for r in rows)
    lines.append(f"{'cell':{width}}  {'metric':>16}  {'A':>12}  {'B':>12}  {'change':>8}  {'noise band':>10}  verdict")
    for r in rows:
        lines.append(f"{r['cell']:{width}}  {r['metric']:>16}  {r['a']:>12,.1f}  {r['b']:>12,.1f}  "
                     f"{100 * r['change']:>+7.1f}%  {100 * r['band']:>9.1f}%  {r['verdict']}")
    worse = sum(r["verdict"] == "WORSE" for r in rows)
    lines.append(f"{worse} metric(s) worse beyond the noise band, "
                 f"{sum(r['verdict'] == 'better' for r in rows)} better, {len(rows)} compared")
    return "\n".join(lines)
