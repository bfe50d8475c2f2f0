"""`scalerl bench`: measure the matrix, cell by cell, into `benchmark_report.json`.

Order: check every cell's config (a cell whose overrides the installed config refuses is skipped with the
config's message), probe the links (loopback, and each emulated network), run the calibration cell (one
rank: compute rates and the baselines) and the other cells (identical configurations run once), then
derive scaling efficiency, baselines and the cost model's validation, and write the report.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from scalerl.bench.calibration import (
    cell_layout,
    cell_model,
    cell_step,
    compute_rates,
    link_key,
)
from scalerl.bench.cell_runner import Launcher, probe_links, read_cell_files
from scalerl.bench.cost_model.step_traffic import bytes_by_kind, step_collectives
from scalerl.bench.matrix import BENCH_BASE, BenchMatrix, Cell
from scalerl.bench.progress import BenchProgress
from scalerl.bench.schema import new_report, write_report
from scalerl.bench.summary import scaling_efficiency, stats, summarize
from scalerl.bench.validation import validate_cells, validation_summary
from scalerl.core.algorithm_names import needs_critic
from scalerl.core.config import ConfigError, load_config
from scalerl.core.errors import UserError
from scalerl.launch.emulated_cluster import (
    EmulatedClusterError,
    require_root_and_iproute2,
)
from scalerl.perf.mfu_waterfall import run_waterfall


class BenchError(UserError):
    """The matrix cannot run here; the message says why and what to do."""


def _cell_config(matrix: BenchMatrix, cell: Cell, samples: int, scratch: Path) -> tuple[list[str], Any]:
    overrides = matrix.cell_overrides(cell, samples) + [f"trainer.output_dir={scratch}"]
    return overrides, load_config(None, overrides)


def _shape(cfg: Any) -> dict[str, Any]:
    """What the cost model needs from the cell's config (global sizes; per-rank shares come later)."""
    # the trainer recomputes old log-probs unless the rollout's are an fp32 forward of the latest weights
    standalone_exact = cfg.rollout.dtype == "fp32" and (not cfg.rollout.staleness
                                                        or cfg.rollout.stale_logprobs == "behavior")
    recompute = cfg.trainer.precision != "fp32" or (cfg.rollout.placement == "standalone" and not standalone_exact)
    return {"micro_rows": cfg.actor.ppo_micro_batch_size, "mini_rows": cfg.actor.ppo_mini_batch_size,
            "epochs": cfg.actor.ppo_epochs,
            "forward_passes": (int(recompute) + int(cfg.actor.use_kl_loss)
                               + int(needs_critic(cfg.algorithm.adv_estimator))),
            "pp_width": cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
            "pp_microbatches": cfg.parallel.microbatches}


def _samples_per_prompt(matrix: BenchMatrix) -> int:
    cfg = load_config(None, [*BENCH_BASE, *matrix.overrides])
    return cfg.rollout.n


def run_bench(matrix: BenchMatrix, output: str | Path, command: str = "scalerl bench",
              doctor: dict[str, Any] | None = None, cell_timeout_s: float | None = None,
              work_dir: str | Path | None = None, progress_stream=None) -> dict[str, Any]:
    cells, skipped = matrix.cells()
    samples = _samples_per_prompt(matrix)
    work = Path(work_dir or tempfile.mkdtemp(prefix="scalerl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    planned: list[tuple[Cell, list[str], Any]] = []
    for cell in cells:
        try:
            overrides, cfg = _cell_config(matrix, cell, samples, work / "scratch")
        except ConfigError as e:
            skipped.append({**cell.to_dict(), "status": "skipped", "reason": f"config refused: {e}"})
            continue
        planned.append((cell, overrides, cfg))
    if any(cell.total_nodes > 1 for cell, _, _ in planned):
        try:
            require_root_and_iproute2()
        except EmulatedClusterError as e:
            nodes = max(cell.total_nodes for cell, _, _ in planned)
            raise BenchError(f"{nodes} nodes means emulated nodes on this machine (network namespaces joined by "
                             f"shaped links), and {e}; or measure one node only (--nodes 1)") from None
    report = new_report(command, {**matrix.to_dict(), "base_overrides": list(BENCH_BASE),
                                  "samples_per_prompt": samples})
    report["doctor"] = doctor
    timeout = cell_timeout_s or 120 + 20 * (matrix.warmup + matrix.steps)
    unique: dict[tuple, dict[str, Any]] = {}
    probes = {("loopback",)} if any(c.world + c.workers > 1 for c, _, _ in planned) else set()
    probes |= {(c.total_nodes, c.rate_mbit) for c, _, _ in planned if c.total_nodes > 1}
    with BenchProgress(len(planned) + len(probes), progress_stream) as progress, Launcher(progress.log) as launcher:
        for probe in sorted(probes, key=str):
            nodes, rate = (1, 0.0) if probe == ("loopback",) else probe
            name = "loopback" if nodes == 1 else link_key(nodes, rate)
            progress.start(f"link probe: {name}")
            rpn = matrix.ranks_per_node if nodes > 1 else 2
            report["links"][name] = probe_links(launcher, nodes, rpn, rate, work)
            progress.advance(_describe_probe(name, report["links"][name]))
        for cell, overrides, cfg in planned:
            progress.start(f"cell {cell.id}")
            key = (tuple(o for o in overrides if not o.startswith("trainer.output_dir=")), cell.total_nodes,
                   cell.rate_mbit, cell.ranks_per_node)
            if key in unique:
                result = {**unique[key], **cell.to_dict(), "same_as": unique[key]["id"]}
            else:
                result = _run_cell(launcher, matrix, cell, overrides, cfg, work, timeout)
                unique[key] = result
            report["cells"].append(result)
            progress.advance(_describe_cell(result))
    report["cells"] += skipped
    scaling_efficiency(report["cells"])
    report["baselines"] = summarize_baselines(report["cells"])
    calibration = next((c for c in report["cells"] if c.get("calibration") and c["status"] == "ok"), None)
    if calibration is not None:
        rates = compute_rates(calibration)
        report["calibration"] = {"compute": rates.to_dict(), "links": report["links"],
                                 "cell": calibration["id"]}
        report["validation"] = validate_cells(report)
        report["calibration"]["validation_summary"] = validation_summary(report["validation"])
    report["environment"]["load_average_after"] = list(os.getloadavg())
    write_report(report, output)
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _run_cell(launcher: Launcher, matrix: BenchMatrix, cell: Cell, overrides: list[str], cfg: Any, work: Path,
              timeout: float) -> dict[str, Any]:
    out_dir = Path(tempfile.mkdtemp(prefix="cell-", dir=work))
    spec = {"overrides": overrides, "warmup": matrix.warmup, "steps": matrix.steps, "out_dir": str(out_dir),
            "threads": matrix.threads_per_rank, "calibration": cell.calibration,
            "baselines": cell.calibration and matrix.baselines}
    result: dict[str, Any] = {**cell.to_dict(), "total_nodes": cell.total_nodes, "overrides": overrides,
                              "dp": cell.dp, "shape": _shape(cfg)}
    outcome = launcher.run("scalerl.bench.cell_rank", spec, cell.total_nodes, cell.launch_ranks_per_node,
                           cell.rate_mbit, timeout, matrix.threads_per_rank)
    files = read_cell_files(out_dir)
    result["wall_s"] = outcome.seconds
    complete = bool(files.steps) and len(files.ranks) == cell.devices
    if not outcome.ok and complete:
        # every rank wrote its results before one failed on its way out: the measurement stands, the
        # failed exit is reported with the cell
        result["exit_warning"] = outcome.reason
    elif not outcome.ok or not files.steps:
        return {**result, "status": "failed", "reason": outcome.reason or "the cell wrote no step metrics"}
    rows = cfg.trainer.batch_size * cfg.rollout.n
    result.update(status="ok", model=files.model, **summarize(cell, files, rows, matrix.threads_per_rank))
    result["baseline_rounds"] = files.baselines
    if files.compute_probe:
        result["compute_probe"] = files.compute_probe
    result["update_s_paired"] = [s["timing_s/update_actor"] for s in files.steps if s.get("bench/baseline_after")]
    # the MFU gap of the cell's steps, slice by slice (`scalerl report` draws it)
    layout = {"pp": cell.parallel.get("pp", 1), "microbatches": cfg.parallel.microbatches,
              "pp_schedule": cfg.parallel.pp_schedule}
    result["mfu_waterfall"] = run_waterfall(files.steps, layout).to_json()
    fractions = [s["weight_sync/bytes"] / s["weight_sync/full_bytes"] for s in files.steps
                 if s.get("weight_sync/full_bytes")]
    if fractions:
        result["weight_sync_fraction"] = statistics.median(fractions)
    if cell.compression != "none":
        result["grad_ratio"] = _grad_ratio(result)
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _grad_ratio(cell: dict[str, Any]) -> float:
    """Gradient bytes compression sent over the dense reduction's (the cost model times what is sent)."""
    dense = bytes_by_kind(step_collectives(cell_model(cell), cell_step(cell)[0], cell_layout(cell))).get("grad", 0.0)
    return cell["bytes_per_step"]["grad"] / dense if dense else 1.0


def summarize_baselines(cells: list[dict[str, Any]]) -> dict[str, Any]:
    calibration = next((c for c in cells if c.get("calibration") and c.get("status") == "ok"), None)
    if calibration is None:
        return {}
    rounds = calibration.get("baseline_rounds", {})
    out: dict[str, Any] = {"cell": calibration["id"]}
    plain, paired = rounds.get("plain_update_s", []), calibration.get("update_s_paired", [])
    if plain and paired:
        ratio = statistics.median(plain) / statistics.median(paired)
        out["plain_update"] = {"plain_s": stats(plain), "scalerl_s": stats(paired), "ratio": ratio, "target": 1.0,
                               "meets_target": ratio >= 1.0,
                               "what": "actor update of the same batches: plain PyTorch loop time / scalerl's "
                                       "timing_s/update_actor (>= 1.0: no framework overhead)"}
    if rounds.get("generate_hf_s"):
        tokens = rounds["generate_tokens"][0]
        hf = tokens / statistics.median(rounds["generate_hf_s"])
        ours = tokens / statistics.median(rounds["generate_scalerl_s"])
        out["generate"] = {"hf_tokens_per_s": hf, "scalerl_tokens_per_s": ours, "ratio": ours / hf,
                           "tokens_per_round": tokens, "rounds": len(rounds["generate_hf_s"]),
                           "what": "rollout phase: built-in engine vs HF generate, same weights and prompts, "
                                   "fixed length, tokens/s"}
    return out


def _describe_probe(name: str, fitted: dict[str, Any]) -> str:
    if "error" in fitted:
        return f"{name}: probe failed: {fitted['error'].splitlines()[0]}"
    parts = [f"{scope} {d['bytes_per_s'] / 1e6:.1f} MB/s, alpha {d['alpha_s'] * 1e6:.0f} us"
             for scope, d in fitted.items()]
    return f"{name}: " + "; ".join(parts)


def _describe_cell(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"{result['id']}: {result['status']}: {result['reason'].splitlines()[0]}"
    tps = result["throughput"]["tokens_per_s"]["median"]
    step = result["latency_ms"]["step"]["median"]
    return f"{result['id']}: {tps:,.0f} tokens/s, {step:.0f} ms/step" + (
        f" (same as {result['same_as']})" if result.get("same_as") else "")
