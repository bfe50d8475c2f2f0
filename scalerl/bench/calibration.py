"""The cost model's inputs taken from measurements: compute rates per phase from the calibration cell (one
rank, so no communication in its times), links from the link probes or from a `scalerl doctor` report's
all-reduce sweeps, and for every measured cell the model, step shape and layout it ran.
"""

from __future__ import annotations

from typing import Any

from scalerl.bench.cost_model.collective_cost import LINK_PRESETS, LinkCost, fit_link
from scalerl.bench.cost_model.step_projection import (
    ComputeRates,
    Links,
    TokenLengths,
    phase_flops,
)
from scalerl.bench.cost_model.step_traffic import Layout, StepShape
from scalerl.models.config import ModelConfig
from scalerl.models.hf_checkpoint import model_config_from_hf
from scalerl.perf.flops import flops_per_token, forward_flops_per_token
from scalerl.perf.mfu import StepWork, generation_flops

FALLBACK_INTRA = "pcie4"  # used only when no loopback was measured and a layout needs an intra-node link


def cell_model(cell: dict[str, Any]) -> ModelConfig:
    return model_config_from_hf(cell["model"]["config"], source=f"cell {cell['id']}")


def cell_step(cell: dict[str, Any]) -> tuple[StepShape, TokenLengths]:
    """The step shape one DP rank of ``cell`` ran, from its configuration and measured lengths."""
    shape, work, dp = cell["shape"], cell["work"], max(1, cell["dp"])
    decode = max(1.0, work["decode_steps"])
    step = StepShape(rows=work["rows"] // dp, prompt_len=work["mean_prompt_len"], response_len=decode,
                     train_width=work["mean_prompt_len"] + decode, micro_rows=shape["micro_rows"],
                     mini_rows=max(1, shape["mini_rows"] // dp), epochs=shape["epochs"],
                     forward_passes=shape["forward_passes"], pp_width=shape["pp_width"],
                     pp_microbatches=shape["pp_microbatches"])
    return step, TokenLengths(work["mean_prompt_len"], work["mean_response_len"])


def cell_layout(cell: dict[str, Any]) -> Layout:
    par = cell["parallel"]
    ratio = 1.0
    sync = cell.get("weight_sync_fraction")
    if sync is not None:
        ratio = sync
    return Layout(dp_replicate=par["dp_replicate"], dp_shard=par["dp_shard"], tp=par["tp"], pp=par["pp"],
                  sp=par.get("sp", 1), ranks_per_node=cell["ranks_per_node"], grad_ratio=cell.get("grad_ratio", 1.0),
                  allreduce="hierarchical" if _hierarchical(cell) else "flat",
                  rollout_workers=cell.get("workers", 0), weight_sync_ratio=ratio)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of seconds against FLOPs through two or more points; a slope that does not grow is
    taken as 0 FLOP cost (all fixed), a negative intercept as 0 (all FLOPs)."""
    (x1, y1), (x2, y2) = points[0], points[-1]
    slope = (y2 - y1) / (x2 - x1) if x2 != x1 else 0.0
    if slope <= 0:
        return min(y for _, y in points), 0.0
    intercept = y1 - slope * x1
    if intercept < 0:
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)
    return intercept, slope


def probe_fit(model: ModelConfig, probe: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per phase (fixed seconds per call, seconds per FLOP) from the calibration cell's compute probe."""
    train = [(p["rows"] * p["width"] * flops_per_token(model, p["width"]), p["seconds"]) for p in probe["train"]]
    forward = [(p["rows"] * p["width"] * forward_flops_per_token(model, p["width"]), p["seconds"])
               for p in probe["forward"]]
    gen = []
    for p in probe["gen"]:
        work = StepWork(p["rows"] * p["prompt_len"], p["rows"] * p["new_tokens"], p["prompt_len"], p["new_tokens"])
        gen.append((generation_flops(model, work), p["seconds"]))
    steps = probe["gen"][0]["new_tokens"]
    gen_fixed, gen_slope = _line(gen)
    return {"train": _line(train), "forward": _line(forward), "gen": (gen_fixed / steps, gen_slope)}


def _hierarchical(cell: dict[str, Any]) -> bool:
    """Whether the cell's gradient all-reduce ran hierarchically: as its reducer reported
    (``comm/allreduce/hierarchical``, which ``comm.allreduce=auto`` decides at start), else as configured."""
    reported = cell.get("comm_choice", {}).get("hierarchical")
    return reported >= 0.5 if reported is not None else cell.get("allreduce") == "hierarchical"


def compute_rates(calibration: dict[str, Any]) -> ComputeRates:
    """Per-phase costs of this device, matched to the calibration cell's median phase times (one rank, no
    waits): with a compute probe, its split into fixed cost per call and cost per FLOP is kept and both are
    scaled so the calibration cell's own phases come out exactly (that absorbs what the probe leaves out,
    e.g. the optimizer step); without one, all of a phase's time is taken as FLOPs."""
    model = cell_model(calibration)
    step, lengths = cell_step(calibration)
    layout = cell_layout(calibration)
    flops = phase_flops(model, step, layout, lengths)
    lat = calibration["latency_ms"]
    gen_s = lat["gen"]["median"] / 1e3
    update_s = lat["update_actor"]["median"] / 1e3
    forward_s = sum(lat[k]["median"] for k in ("old_log_prob", "ref") if k in lat) / 1e3
    known = gen_s + update_s + forward_s + sum(lat[k]["median"] for k in ("update_weights",) if k in lat) / 1e3
    other = max(0.0, lat["step"]["median"] / 1e3 - known)
    fit = probe_fit(model, calibration["compute_probe"]) if calibration.get("compute_probe") else None
    calls = {"gen": step.response_len, "train": step.micro_batches,
             "forward": step.forward_passes * -(-step.rows // step.micro_rows)}

    def matched(phase: str, measured: float, phase_flops_: float) -> tuple[float, float]:
        """(fixed seconds per call, FLOP/s) reproducing ``measured`` for this cell's calls and FLOPs."""
        if fit is None or phase not in fit:
            return 0.0, phase_flops_ / measured
        fixed, per_flop = fit[phase]
        predicted = calls[phase] * fixed + phase_flops_ * per_flop
        scale = measured / predicted if predicted > 0 else 1.0
        return fixed * scale, (1.0 / (per_flop * scale) if per_flop > 0 else float("inf"))

    gen_step, gen_rate = matched("gen", gen_s, flops["gen"])
    train_call, train_rate = matched("train", update_s, flops["update"])
    if flops["forward"] and forward_s > 0:
        forward_call, forward_rate = matched("forward", forward_s, flops["forward"])
    elif fit is not None:  # not measured in the cell: the probe's own figures
        forward_call, per_flop = fit["forward"]
        forward_rate = 1.0 / per_flop if per_flop > 0 else float("inf")
    else:
        forward_call, forward_rate = 0.0, train_rate * 3
    cpu = calibration.get("cpu", {})
    return ComputeRates(
        gen_flops_per_s=gen_rate, train_flops_per_s=train_rate, forward_flops_per_s=forward_rate,
        other_s_per_row=other / max(1, step.rows), gen_step_s=gen_step, train_call_s=train_call,
        forward_call_s=forward_call,
        source=f"measured: calibration cell {calibration['id']} ({calibration['measured_steps']} steps, "
               f"1 rank x {int(cpu.get('threads_per_rank', 1))} thread, median phase times"
               + (", split into per-call and per-FLOP costs by a compute probe" if fit else "") + ")")


def links_for(report: dict[str, Any], cell: dict[str, Any] | None = None, inter_name: str | None = None) -> Links:
    """The intra-node link (loopback as probed here) and the inter-node one: the cell's own emulated link,
    a preset name, ``doctor`` (the report's doctor sweeps), or the fastest measured one."""
    links = report.get("links", {})
    intra_data = links.get("loopback", {}).get("intra")
    intra = LinkCost.from_dict(intra_data) if intra_data else LINK_PRESETS[FALLBACK_INTRA]
    if inter_name in LINK_PRESETS:
        return Links(intra, LINK_PRESETS[inter_name])
    if inter_name == "doctor":
        return Links(intra, doctor_link(report["doctor"]))
    if cell is not None and cell.get("total_nodes", cell["nodes"]) > 1:
        key = link_key(cell.get("total_nodes", cell["nodes"]), cell["rate_mbit"])
        data = links.get(key, {}).get("inter")
        if data:
            return Links(intra, LinkCost.from_dict(data))
    measured = [v["inter"] for v in links.values() if isinstance(v, dict) and v.get("inter")]
    if measured:
        return Links(intra, LinkCost.from_dict(max(measured, key=lambda d: d["bytes_per_s"])))
    # Nothing measured between nodes: the projection treats the inter-node link as the intra-node one, and
    # says so, instead of naming an intra-node link (a PCIe preset) as if it joined the nodes.
    return Links(intra, LinkCost(intra.alpha_s, intra.bytes_per_s,
                                 f"none measured, so taken as fast as the intra-node link ({intra.source}); "
                                 "measure one with scalerl bench --nodes 2 (emulated nodes) or name one: --link"))


def link_key(nodes: int, rate_mbit: float) -> str:
    return f"{nodes}nodes@{rate_mbit:g}Mbit"


def doctor_link(doctor: dict[str, Any], scope: str = "inter-node", backend: str = "gloo") -> LinkCost:
    """The link fitted to a `scalerl doctor --distributed-check` report's all-reduce sweep of ``scope``
    (``inter-node``: between the nodes' first ranks; ``intra-node``: inside a node, the slowest node's)."""
    sweeps = (doctor or {}).get("measurements", {}).get("bandwidth", {}).get("sweeps", [])
    fitted = []
    for sweep in sweeps:
        if sweep.get("scope") != scope or len(sweep.get("ranks", [])) < 2 or len(sweep.get("results", [])) < 2:
            continue
        p = len(sweep["ranks"])
        where = f"{p} nodes" if scope == "inter-node" else f"{p} ranks on {sweep.get('node', 'one node')}"
        fitted.append(fit_link([r["size"] for r in sweep["results"]], [r["time_s"] for r in sweep["results"]],
                               "all_reduce", p, backend, source=f"measured: scalerl doctor {scope} sweep, {where}"))
    if not fitted:
        raise ValueError(f"the doctor report has no {scope} all-reduce sweep of two or more ranks (run scalerl doctor "
                         f"--distributed-check --json on {'2+ nodes' if scope == 'inter-node' else 'a node of 2+ ranks'})")
    return min(fitted, key=lambda link: link.bytes_per_s)
