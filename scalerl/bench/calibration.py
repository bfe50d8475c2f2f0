"""The cost model's inputs taken from measurements: compute rates per phase from the calibration cell (one
rank, so no communication in its times), links from the link probes or from a `scalerl doctor` report's
all-reduce sweeps, and for every measured cell the model, step shape and layout it ran.
"""

from __future__ import annotations

from typing import Any

from scalerl.models.config import ModelConfig
from scalerl.models.hf_checkpoint import model_config_from_hf
from scalerl.perf.collective_cost import LINK_PRESETS, LinkCost, fit_link
from scalerl.perf.step_projection import ComputeRates, Links, TokenLengths, phase_flops
from scalerl.perf.step_traffic import Layout, StepShape

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
                  ranks_per_node=cell["ranks_per_node"], grad_ratio=cell.get("grad_ratio", 1.0),
                  allreduce="hierarchical" if cell.get("allreduce") == "hierarchical" else "flat",
                  rollout_workers=cell.get("workers", 0), weight_sync_ratio=ratio)


def compute_rates(calibration: dict[str, Any]) -> ComputeRates:
    """Effective FLOP/s per phase of the calibration cell (median phase times, one rank, no waits)."""
    model = cell_model(calibration)
    step, lengths = cell_step(calibration)
    flops = phase_flops(model, step, cell_layout(calibration), lengths)
    lat = calibration["latency_ms"]
    gen_s = lat["gen"]["median"] / 1e3
    update_s = lat["update_actor"]["median"] / 1e3
    forward_s = sum(lat[k]["median"] for k in ("old_log_prob", "ref") if k in lat) / 1e3
    known = gen_s + update_s + forward_s + sum(lat[k]["median"] for k in ("update_weights",) if k in lat) / 1e3
    other = max(0.0, lat["step"]["median"] / 1e3 - known)
    train_rate = flops["update"] / update_s
    forward_rate = flops["forward"] / forward_s if flops["forward"] and forward_s > 0 else train_rate
    cpu = calibration.get("cpu", {})
    return ComputeRates(
        gen_flops_per_s=flops["gen"] / gen_s, train_flops_per_s=train_rate, forward_flops_per_s=forward_rate,
        other_s_per_row=other / max(1, step.rows),
        source=f"measured: calibration cell {calibration['id']} ({calibration['measured_steps']} steps, "
               f"1 rank x {int(cpu.get('threads_per_rank', 1))} thread, median phase times)")


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
    return Links(intra, intra)


def link_key(nodes: int, rate_mbit: float) -> str:
    return f"{nodes}nodes@{rate_mbit:g}Mbit"


def doctor_link(doctor: dict[str, Any]) -> LinkCost:
    """The inter-node link fitted to a `scalerl doctor --distributed-check` report's inter-node sweep."""
    sweeps = (doctor or {}).get("measurements", {}).get("bandwidth", {}).get("sweeps", [])
    inter = next((s for s in sweeps if s.get("scope") == "inter-node"), None)
    if inter is None:
        raise ValueError("the doctor report has no inter-node all-reduce sweep (run it on 2+ nodes with "
                         "--distributed-check)")
    sizes = [r["size"] for r in inter["results"]]
    seconds = [r["time_s"] for r in inter["results"]]
    p = len(inter.get("ranks", [])) or 2
    return fit_link(sizes, seconds, "all_reduce", p, source=f"measured: scalerl doctor inter-node sweep, {p} nodes")
