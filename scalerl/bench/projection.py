"""Projected throughput, step time, scaling efficiency and per-node resources at N nodes x G devices, from the
cost model calibrated on a benchmark report: tokens/s by nodes x strategy beside the ideal linear line,
ms per batch, and per device / per node resources. Every number here is a projection, labelled so, with
the calibration it came from.

Inputs: the model (the one the report measured, or a Qwen2.5 size), the batch per data-parallel rank (the
measured one, or given), the inter-node link (the measured emulated link, a `scalerl doctor` sweep, or a
nominal preset: ib-ndr, ib-hdr, 100gbe, 25gbe) and the intra-node link (measured loopback or a preset),
and the device (this machine's measured rates, or a GPU's datasheet peak x an MFU the user states).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from scalerl.bench.calibration import cell_model, cell_step, compute_rates, links_for
from scalerl.bench.cost_model.collective_cost import LINK_PRESETS
from scalerl.bench.cost_model.model_shapes import model_shape
from scalerl.bench.cost_model.step_projection import (
    ComputeRates,
    Links,
    TokenLengths,
    project_step,
)
from scalerl.bench.cost_model.step_traffic import Layout, StepShape
from scalerl.bench.matrix import NotApplicable, strategy_layout
from scalerl.perf.flops import datasheet_peak_flops

# Datasheet memory per GPU (GB), for the "fits" column.
DEVICE_MEMORY_GB = {"h100": 80, "h200": 141, "a100": 80, "l40s": 48, "a10": 24, "l4": 24, "mi300x": 192}


@dataclass
class ProjectionTarget:
    nodes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    devices_per_node: int = 1
    strategies: list[str] = field(default_factory=lambda: ["ddp", "fsdp", "hsdp"])
    model: str = "measured"  # or qwen2.5-0.5b ... qwen2.5-72b
    link: str = "measured"  # measured | doctor | a LINK_PRESETS name
    intra_link: str = "measured"  # measured (loopback here) | a LINK_PRESETS name
    device: str = "measured"  # measured | h100 | h200 | a100 | ...
    mfu_train: float | None = None  # required for a GPU device: the MFU assumed for training passes
    mfu_gen: float | None = None  # and for generation
    rows_per_rank: int | None = None  # sequences per DP rank per step; default: the measured batch
    prompt_len: float | None = None
    response_len: float | None = None


def _rates(report: dict[str, Any], calibration: dict[str, Any], target: ProjectionTarget) -> ComputeRates:
    measured = compute_rates(calibration)
    if target.device == "measured":
        return measured
    if target.mfu_train is None or target.mfu_gen is None:
        raise ValueError(f"--device {target.device}: state the MFU to assume with --mfu-train and --mfu-gen "
                         "(e.g. from `scalerl doctor --performance-profiling` on that GPU)")
    peak = datasheet_peak_flops(target.device, torch.bfloat16)
    return ComputeRates(peak * target.mfu_gen, peak * target.mfu_train, peak * target.mfu_train,
                        measured.other_s_per_row,
                        source=f"assumed: {target.device.upper()} bf16 datasheet peak {peak / 1e12:.0f} TFLOP/s x "
                               f"MFU {target.mfu_train:g} (train) / {target.mfu_gen:g} (generation)")


def _links(report: dict[str, Any], target: ProjectionTarget) -> Links:
    links = links_for(report, None, None if target.link == "measured" else target.link)
    if target.intra_link != "measured":
        links = Links(LINK_PRESETS[target.intra_link], links.inter)
    return links


def _shape(calibration: dict[str, Any], target: ProjectionTarget, model_name: str) -> tuple[StepShape, TokenLengths]:
    step, lengths = cell_step(calibration)
    if model_name != "measured":  # a named model: lengths and batch from the target, else typical RL ones
        lengths = TokenLengths(target.prompt_len or 256, target.response_len or 512)
        rows = target.rows_per_rank or 64
        step = replace(step, rows=rows, micro_rows=min(rows, 4), mini_rows=max(1, rows // 2),
                       prompt_len=lengths.prompt, response_len=lengths.response,
                       train_width=lengths.prompt + lengths.response, pp_width=int(lengths.prompt + lengths.response),
                       act_bytes=2, param_bytes=2)
    else:
        if target.prompt_len or target.response_len:
            lengths = TokenLengths(target.prompt_len or lengths.prompt, target.response_len or lengths.response)
            step = replace(step, prompt_len=lengths.prompt, response_len=lengths.response,
                           train_width=lengths.prompt + lengths.response)
        if target.rows_per_rank:
            step = replace(step, rows=target.rows_per_rank, mini_rows=max(1, target.rows_per_rank // 2))
    return step, lengths


def project(report: dict[str, Any], target: ProjectionTarget) -> dict[str, Any]:
    """Projected rows for every (strategy, nodes) of ``target``: step, throughput, efficiency, resources."""
    calibration = next((c for c in report["cells"] if c.get("calibration") and c.get("status") == "ok"), None)
    if calibration is None:
        raise ValueError("the report has no measured calibration cell: nothing to calibrate the cost model from")
    model = cell_model(calibration) if target.model == "measured" else model_shape(target.model)
    step, lengths = _shape(calibration, target, target.model)
    rates, links = _rates(report, calibration, target), _links(report, target)
    g = target.devices_per_node
    memory_limit = DEVICE_MEMORY_GB.get(target.device)
    rows: list[dict[str, Any]] = []
    for strategy in target.strategies:
        base = None
        for nodes in sorted(set(target.nodes)):
            try:
                par = strategy_layout(strategy, nodes * g, g)
            except NotApplicable as e:
                rows.append({"strategy": strategy, "nodes": nodes, "devices": nodes * g, "skipped": str(e)})
                continue
            problem = _layout_problem(model, par)
            if problem:
                rows.append({"strategy": strategy, "nodes": nodes, "devices": nodes * g, "skipped": problem})
                continue
            layout = Layout(**par, ranks_per_node=g, backend="gloo" if target.device == "measured" else "nccl")
            est = project_step(model, step, layout, lengths, rates, links)
            row = {"strategy": strategy, "nodes": nodes, "devices": nodes * g, "layout": par,
                   "step_s": est.step_s, "tokens_per_s": est.tokens_per_s, "compute_s": est.compute_total_s,
                   "comm_s": est.comm_total_s, "comm_share": est.comm_total_s / est.step_s if est.step_s else 0.0,
                   "memory_gb": est.memory_gb, "node_link_bytes_per_s": est.node_link_bytes_per_s,
                   "link_utilization": est.node_link_bytes_per_s / links.inter.bytes_per_s if nodes > 1 else 0.0,
                   "bytes_per_rank": est.bytes_per_rank, "tokens_per_step": est.tokens_per_step}
            if memory_limit:
                row["fits"] = est.memory_gb <= memory_limit
            base = base or row
            row["scaling_efficiency"] = row["tokens_per_s"] / (base["tokens_per_s"] * row["devices"] / base["devices"])
            rows.append(row)
    ok = [r for r in rows if "skipped" not in r]
    first = [r for r in ok if r["nodes"] == min(r2["nodes"] for r2 in ok)] if ok else []
    fitting = [r for r in first if r.get("fits", True)] or first  # the ideal line starts from what fits
    best_one = max((r["tokens_per_s"] / r["devices"] for r in fitting), default=0.0)
    return {
        "label": "PROJECTED by the cost model (not measured)",
        "model": model.extra.get("name") or (calibration["model"].get("name", "measured model")),
        "params": calibration["model"].get("params") if target.model == "measured" else None,
        "step": {"rows_per_rank": step.rows, "prompt_len": lengths.prompt, "response_len": lengths.response},
        "devices_per_node": g, "device": target.device,
        "calibration": {"compute": rates.source, "inter_link": links.inter.source, "intra_link": links.intra.source,
                        "report_created": report.get("created"), "git_commit": report["environment"].get("git_commit"),
                        "validation": report.get("calibration", {}).get("validation_summary")},
        "ideal_per_device": best_one, "rows": rows,
    }


def _layout_problem(model, par: dict[str, int]) -> str | None:
    if model.num_key_value_heads % par["tp"] or model.num_attention_heads % par["tp"]:
        return f"tp={par['tp']} does not divide the model's {model.num_key_value_heads} kv heads"
    if model.num_hidden_layers % par["pp"]:
        return f"pp={par['pp']} does not divide the model's {model.num_hidden_layers} layers"
    return None
