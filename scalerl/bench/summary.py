"""A cell's figures from its measured steps: medians and spreads over steps of throughput, latency per phase,
MFU, bytes and communication time by kind; CPU use from the ranks' own counters; scaling efficiency
against the same strategy's one-node cell.

A step's time is its slowest rank's (``timing_s/step/max``): the next step cannot start before it ends.
Phase times are the mean over ranks; ``comm_exposed`` is the time ranks spent blocked in collectives
(``timing_s/comm/*``, measured where the collectives are synchronous or their wait is exposed;
TP and pipeline sends are counted in bytes only, see docs/comm-accounting.md).
"""

from __future__ import annotations

import statistics
from typing import Any

from scalerl.bench.cell_runner import CellFiles
from scalerl.bench.matrix import Cell

PHASES = ("data", "gen", "reward", "old_log_prob", "ref", "teacher", "adv", "balance", "update_critic", "update_actor",
          "update_weights")
COMM_KINDS = ("grad", "param", "tp", "pp", "rebalance", "weight_sync", "rollout", "metrics")


def stats(values: list[float]) -> dict[str, float]:
    """median, quartiles, min, max, count and the relative spread (interquartile range / median)."""
    values = sorted(float(v) for v in values)
    if not values:
        return {"n": 0}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    median = statistics.median(values)
    return {"median": median, "p25": q[0], "p75": q[2], "min": values[0], "max": values[-1], "n": len(values),
            "rel_iqr": (q[2] - q[0]) / median if median else 0.0}


def _series(steps: list[dict], key: str, scale: float = 1.0) -> list[float]:
    return [s[key] * scale for s in steps if key in s]


def summarize(cell: Cell, files: CellFiles, rows_per_step: int, threads: int) -> dict[str, Any]:
    """The measured figures of one cell (``status`` ok), from its files."""
    steps = files.steps
    step_s = [s.get("timing_s/step/max", s["timing_s/step"]) for s in steps]
    tokens = _series(steps, "perf/total_num_tokens")
    tps = [t / s for t, s in zip(tokens, step_s)]
    out: dict[str, Any] = {
        "measured_steps": len(steps),
        "throughput": {"tokens_per_s": stats(tps), "tokens_per_s_per_device": stats([v / cell.devices for v in tps]),
                       "tokens_per_step": stats(tokens)},
        "latency_ms": {"step": stats([v * 1e3 for v in step_s])},
        "mfu": {name: stats(_series(steps, key)) for name, key in
                (("step", "perf/mfu"), ("gen", "perf/mfu/gen"), ("update", "perf/mfu/update")) if _series(steps, key)},
        "memory": {"peak_gb": max(_series(steps, "perf/max_memory_gb") or [0.0])},
    }
    mean_step = _series(steps, "timing_s/step")
    phase_sum = [0.0] * len(steps)
    for phase in PHASES:
        series = [s.get(f"timing_s/{phase}", 0.0) for s in steps]
        if any(series):
            out["latency_ms"][phase] = stats([v * 1e3 for v in series])
            phase_sum = [a + b for a, b in zip(phase_sum, series)]
    exposed = [sum(s.get(f"timing_s/comm/{k}", 0.0) for k in COMM_KINDS) for s in steps]
    out["latency_ms"]["comm_exposed"] = stats([v * 1e3 for v in exposed])
    out["latency_ms"]["other"] = stats([max(0.0, m - p) * 1e3 for m, p in zip(mean_step, phase_sum)])
    out["bytes_per_step"], out["bytes_per_s"], out["comm_s"] = {}, {}, {}
    for kind in (*COMM_KINDS, "total"):
        series = [s.get(f"comm/bytes/{kind}", 0.0) for s in steps]
        out["bytes_per_step"][kind] = statistics.median(series) if series else 0.0
        out["bytes_per_s"][kind] = statistics.median([b / t for b, t in zip(series, step_s)]) if series else 0.0
        if kind != "total" and any(f"timing_s/comm/{kind}" in s for s in steps):
            out["comm_s"][kind] = statistics.median(_series(steps, f"timing_s/comm/{kind}"))
    out["work"] = _work(steps, rows_per_step)
    choice = {name: statistics.median(_series(steps, key)) for name, key in
              (("hierarchical", "comm/allreduce/hierarchical"), ("compression_active", "comm/compression/active"))
              if _series(steps, key)}
    if choice:  # what the gradient reducer did (comm.allreduce=auto decides per run; compression after warm-up)
        out["comm_choice"] = choice
    out["cpu"] = _cpu(files.ranks, threads)
    return out


def _work(steps: list[dict], rows_per_step: int) -> dict[str, float]:
    """Sequences, mean prompt and response lengths and decode steps of the median step (the cost model's input)."""
    response_mean = statistics.median(_series(steps, "response_length/mean") or [0.0])
    response_max = statistics.median(_series(steps, "response_length/max") or [0.0])
    tokens = statistics.median(_series(steps, "perf/total_num_tokens") or [0.0])
    prompt = max(0.0, tokens / max(1, rows_per_step) - response_mean)
    return {"rows": rows_per_step, "mean_prompt_len": prompt, "mean_response_len": response_mean,
            "decode_steps": response_max}


def _cpu(ranks: list[dict], threads: int) -> dict[str, float]:
    """Cores each rank kept busy while stepping, the host's busy cores over rank 0's steps, and what other
    processes used (host minus our ranks). ``contention``: trainer ranks x threads per free core (the
    trainer's ranks compute at the same time; standalone workers generate while they wait), what the cost
    model applies to compute and message latency on this host."""
    trainers = [r for r in ranks if r.get("role") == "trainer" and r.get("wall_s")]
    if not trainers:
        return {}
    per_rank = [sum(r["cpu_s"]) / sum(r["wall_s"]) for r in trainers]
    workers = [r for r in ranks if r.get("role") == "rollout_worker" and r.get("wall_s")]
    ours = sum(per_rank) + sum(sum(r["cpu_s"]) / max(1e-9, sum(r["wall_s"])) for r in workers)
    lead = next(r for r in trainers if r["rank"] == min(t["rank"] for t in trainers))
    host = sum(lead.get("host_busy_s", [])) / sum(lead["wall_s"]) if lead.get("host_busy_s") else None
    cores = float(lead.get("cores") or 1)
    out = {"utilization_per_rank": statistics.mean(per_rank), "utilization_max_rank": max(per_rank),
           "cores": cores, "ranks": float(len(ranks)), "threads_per_rank": float(threads)}
    if host is not None:
        others = max(0.0, host - ours)
        out.update(host_busy_cores=host, host_utilization=host / cores, other_load_cores=others,
                   contention=max(1.0, len(trainers) * threads / max(0.25, cores - others)))
    return out


def scaling_efficiency(cells: list[dict[str, Any]]) -> None:
    """``scaling_efficiency`` of each measured cell: its throughput over (devices / reference devices) x the
    reference's, the reference being the one-node cell of the same strategy and variant (or the world-1
    calibration cell when the curve has one rank per node and no one-node cell)."""
    measured = [c for c in cells if c.get("status") == "ok"]
    calibration = next((c for c in measured if c.get("calibration")), None)
    for cell in measured:
        ref = next((c for c in measured if c["nodes"] == 1 and c["strategy"] == cell["strategy"]
                    and c["ranks_per_node"] == cell["ranks_per_node"] and _same_variant(c, cell)), None)
        if ref is None and cell["ranks_per_node"] == 1 and cell["weight_sync"] == "colocated":
            ref = calibration
        if ref is None:
            continue
        mine = cell["throughput"]["tokens_per_s"]["median"]
        base = ref["throughput"]["tokens_per_s"]["median"] * cell["devices"] / ref["devices"]
        cell["scaling_efficiency"] = mine / base if base else None
        cell["scaling_reference"] = ref["id"]


def _same_variant(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("compression", "allreduce", "weight_sync"))
