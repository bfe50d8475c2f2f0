"""Step rules on compute load: stragglers (each rank's own work), data sharding (tokens per data-parallel
rank), model-parallel granularity (tensor-parallel cost model, pipeline bubble), compute precision (fp32
on a device measured faster in bf16)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from scalerl.comm.counting.collective_bytes import wire_bytes
from scalerl.health.thresholds import RULES
from scalerl.health.tree import NOT_MEASURED, OK, PROFILE_HINT, Finding, StepView
from scalerl.health.wording import finding, fix_text


def stragglers(view: StepView) -> list[Finding]:
    rule = RULES["stragglers"]
    ratio_t, excess_t = rule.thresholds["busy_over_median"], rule.thresholds["excess_s"]
    if view.world_size == 1:
        return [finding("stragglers", OK, "one rank: nothing to wait for")]
    if view.per_rank and all("busy_s" in r for r in view.per_rank):
        busy = {r["rank"]: r["busy_s"] for r in view.per_rank}
        median = statistics.median(busy.values())
        slowest = max(busy, key=busy.get)
        step = statistics.median(r["step_s"] for r in view.per_rank)
        basis = "median"
    elif "timing_s/busy/max" in view.metrics:
        median, step = view.metrics["timing_s/busy"], view.metrics.get("timing_s/step", 0.0)
        slowest = int(view.metrics.get("timing_s/busy/slowest_rank", -1))
        busy = {slowest: view.metrics["timing_s/busy/max"]}
        basis = "mean"
    else:
        return [finding("stragglers", NOT_MEASURED,
                         "needs each rank's time blocked in collectives (timing_s/comm/*, comm accounting) to "
                         f"tell a slow rank from the ranks waiting for it; {PROFILE_HINT}")]
    excess = busy[slowest] - median
    ratio = busy[slowest] / median if median > 0 else math.inf
    evidence = {"busy_s_by_rank": {str(k): round(v, 4) for k, v in busy.items()}, f"{basis}_busy_s": round(median, 4),
                "slowest_rank": slowest, "ratio": round(ratio, 3), "step_s": round(step, 4)}
    if view.per_rank:
        steady = _slowest_share(view.per_rank, slowest)
    elif view.history:  # online: how often this rank was the slowest in the last steps
        ranked = [h["timing_s/busy/slowest_rank"] for h in view.history if "timing_s/busy/slowest_rank" in h]
        steady = ranked.count(slowest) / len(ranked) if ranked else None
    else:
        steady = None
    if steady is not None:
        evidence["slowest_in_steps"] = round(steady, 3)
    noise = excess < max(excess_t.warning, 0.05 * step) or \
        (steady is not None and rule.thresholds["slowest_in_steps"].status(steady) == OK)
    status = OK if noise else ratio_t.status(ratio)
    host = next((r.get("host", "") for r in view.per_rank or () if r["rank"] == slowest), "")
    phase = _dominant_phase(view.per_rank, slowest) if view.per_rank else "(per-rank phases need profiling)"
    if status == OK:
        return [finding("stragglers", OK, f"slowest rank {slowest} works {ratio:.2f}x the {basis} rank "
                         f"({busy[slowest]:.3f} s vs {median:.3f} s per step)", evidence)]
    explained = _explained_by_tokens(view, slowest)
    if explained:
        evidence["explained_by"] = explained
        return [finding("stragglers", OK, f"rank {slowest} works {ratio:.2f}x the {basis} rank because it "
                         f"holds the most tokens ({explained}): see data sharding imbalance", evidence, ranks=[slowest])]
    evidence["phase"] = phase
    lost = _others_wait(view.per_rank, slowest, phase) if view.per_rank else None
    waited = "every other rank waits for it"
    if lost is not None:
        evidence["others_wait_s_in_phase"] = round(lost, 4)
        waited = f"the other ranks wait {lost:.3f} s per step for it in {phase}"
    return [finding("stragglers", status,
                     f"rank {slowest}{f' on {host}' if host else ''} works {ratio:.2f}x the {basis} rank "
                     f"({busy[slowest]:.3f} s vs {median:.3f} s per step, most of it in {phase}); {waited}", evidence,
                     fix_text("stragglers", ranks=slowest, hosts=host or "its node", phase=phase),
                     ranks=[slowest], hosts=[host] if host else [])]


def _slowest_share(per_rank: list[dict[str, Any]], rank: int) -> float | None:
    """The share of profiled steps in which ``rank`` was the slowest (None without per-step times)."""
    steps = [r.get("busy_by_step") for r in per_rank]
    if not all(steps) or len({len(s) for s in steps}) != 1:
        return None
    ranks = [r["rank"] for r in per_rank]
    slowest = [ranks[max(range(len(ranks)), key=lambda i: steps[i][k])] for k in range(len(steps[0]))]
    return slowest.count(rank) / len(slowest)


def _dominant_phase(per_rank: list[dict[str, Any]], rank: int) -> str:
    """The phase where ``rank``'s own work exceeds the median rank's the most."""
    mine = next(r for r in per_rank if r["rank"] == rank).get("phases", {})
    excess = {}
    for phase, stats in mine.items():
        others = [r["phases"][phase]["busy_s"] for r in per_rank if phase in r.get("phases", {})]
        excess[phase] = stats["busy_s"] - statistics.median(others)
    return max(excess, key=excess.get) if excess else "the step"


def _others_wait(per_rank: list[dict[str, Any]], rank: int, phase: str) -> float | None:
    """The median time the ranks other than ``rank`` spend waiting (peers and collectives) in ``phase``."""
    waits = [r["phases"][phase]["wait_s"] for r in per_rank
             if r["rank"] != rank and "wait_s" in r.get("phases", {}).get(phase, {})]
    return statistics.median(waits) if waits else None


def _explained_by_tokens(view: StepView, slowest: int) -> str:
    """Why ``slowest`` is slow, if it is the rank with the most tokens under a real token imbalance."""
    if not view.per_rank or not all("update_tokens" in r for r in view.per_rank):
        return ""
    tokens = {r["rank"]: r["update_tokens"] for r in view.per_rank}
    mean = statistics.mean(tokens.values())
    ratio = max(tokens.values()) / mean if mean else 1.0
    if tokens[slowest] < max(tokens.values()) or RULES["token_imbalance"].thresholds["max_over_mean"].status(ratio) == OK:
        return ""
    return f"{tokens[slowest]:.0f} tokens, {ratio:.2f}x the mean"


def token_imbalance(view: StepView) -> list[Finding]:
    threshold = RULES["token_imbalance"].thresholds["max_over_mean"]
    dp = int(view.context.get("dp_size", view.world_size))
    if dp == 1:
        return [finding("token_imbalance", OK, "one data-parallel rank: nothing to balance")]
    if view.per_rank and all("update_tokens" in r for r in view.per_rank):
        tokens = {r["rank"]: r["update_tokens"] for r in view.per_rank}
        mean, top = statistics.mean(tokens.values()), max(tokens.values())
        evidence: dict[str, Any] = {"update_tokens_by_rank": {str(k): v for k, v in tokens.items()}}
    elif "perf/update_tokens/max" in view.metrics:
        mean, top = view.metrics["perf/update_tokens"], view.metrics["perf/update_tokens/max"]
        evidence = {"update_tokens_mean": mean, "update_tokens_max": top}
    else:
        return [finding("token_imbalance", NOT_MEASURED, "no per-rank token counts (perf/update_tokens) in the "
                         "step metrics")]
    ratio = top / mean if mean > 0 else 1.0
    evidence["max_over_mean"] = round(ratio, 3)
    balancing = view.context.get("balance_batch")
    before = view.metrics.get("balance/token_imbalance_before")
    if before is not None:
        evidence["balance/token_imbalance_before"] = round(before, 3)
        evidence["balance/token_imbalance"] = round(view.metrics.get("balance/token_imbalance", ratio), 3)
    status = threshold.status(ratio)
    where = f"(rebalancing on{f', {before:.2f}x before it' if before is not None else ''})" if balancing \
        else "(trainer.balance_batch=false)"
    if balancing is False:
        fix = "trainer.balance_batch=true: rollouts then move between ranks so token counts even out"
    else:
        fix = ("a few long responses dominate: raise trainer.batch_size (more rows to balance), cap "
               "rollout.max_new_tokens, or pack micro-batches by tokens with actor.micro_batch_max_tokens")
    return [finding("token_imbalance", status, f"the busiest data-parallel rank updates on {ratio:.2f}x the mean "
                     f"token count {where}", evidence, fix)]


def parallel_granularity(view: StepView) -> list[Finding]:
    c = view.context
    out = []
    tp = int(c.get("tp", 1))
    if tp == 1:
        out.append(finding("tp_granularity", OK, "no tensor parallelism (parallel.tp=1)"))
    elif not all(k in c for k in ("hidden_size", "layer_params", "dtype_bytes", "peak_flops", "link_busbw")):
        out.append(finding("tp_granularity", NOT_MEASURED, "needs the model size, the device peak and a measured "
                            f"link busbw; {PROFILE_HINT}"))
    else:
        # Per layer and token: 4 all-reduces of the hidden state (2 forward, 2 backward), each rank sending
        # its wire bytes at busbw, against 6 x layer params / tp FLOPs at the device's peak.
        hidden_bytes = c["hidden_size"] * c["dtype_bytes"]
        comm = 4 * wire_bytes("all_reduce", hidden_bytes, tp) / c["link_busbw"]
        compute = 6 * c["layer_params"] / tp / c["peak_flops"]
        ratio = comm / compute
        status = RULES["tp_granularity"].thresholds["comm_over_compute"].status(ratio)
        evidence = {"tp": tp, "hidden_size": c["hidden_size"], "hidden_per_rank": c["hidden_size"] // tp,
                    "comm_over_compute": round(ratio, 3), "link_busbw_gbytes_s": round(c["link_busbw"] / 1e9, 3),
                    "peak_tflops": round(c["peak_flops"] / 1e12, 3)}
        out.append(finding("tp_granularity", status, f"parallel.tp={tp} on hidden size {c['hidden_size']}: "
                            f"tensor-parallel communication is an estimated {ratio:.2f}x its compute", evidence,
                            fix_text("tp_granularity", suggestion=max(1, tp // 2))))
    pp = int(c.get("pp", 1))
    if pp == 1:
        out.append(finding("pp_bubble", OK, "no pipeline parallelism (parallel.pp=1)"))
    else:
        m, v = int(c.get("microbatches", 1)), 2 if c.get("pp_schedule") == "interleaved_1f1b" else 1
        bubble = (pp - 1) / (m * v + pp - 1)
        status = RULES["pp_bubble"].thresholds["bubble"].status(bubble)
        out.append(finding("pp_bubble", status, f"pipeline bubble {bubble:.0%} of each update (pp={pp}, "
                            f"{m} micro-batches, {v} stage(s) per rank)",
                            {"pp": pp, "microbatches": m, "stages_per_rank": v, "bubble": round(bubble, 3)},
                            fix_text("pp_bubble", suggestion=math.ceil(3 * (pp - 1) / v))))
    return out


def unused_bf16(view: StepView) -> list[Finding]:
    """fp32 on a device whose bf16 matmuls were measured faster (`scalerl.perf.precision`'s probe at start)."""
    c = view.context
    precision = c.get("precision")
    if precision is None:
        return [finding("unused_bf16", NOT_MEASURED, f"needs the run's precision and its bf16 probe; {PROFILE_HINT}")]
    if precision != "fp32":
        return [finding("unused_bf16", OK, f"computes in {precision}")]
    hardware = c.get("bf16_hardware", "")
    if not hardware:
        return [finding("unused_bf16", OK, f"fp32: no bf16 matmul hardware on this {c.get('device', 'device')}")]
    if "bf16_over_fp32" not in c:
        return [finding("unused_bf16", NOT_MEASURED, f"fp32 on a device with {hardware}; the bf16 probe did not run")]
    ratio = c["bf16_over_fp32"]
    evidence = {"precision": precision, "bf16_hardware": hardware, "bf16_over_fp32": round(ratio, 3)}
    if c.get("bf16_probe_shape"):
        evidence["probe_shape"] = c["bf16_probe_shape"]
    if c.get("bf16_pays") is False:  # a tiny model: per-op overhead, not the matmuls, sets its step
        return [finding("unused_bf16", OK, f"fp32: the model's matmuls measured {ratio:.2f}x faster in bf16, but "
                         "are too small for bf16 to shorten the step (trainer.precision=auto keeps fp32)", evidence)]
    status = RULES["unused_bf16"].thresholds["bf16_over_fp32"].status(ratio)
    return [finding("unused_bf16", status, f"computes in fp32 on {hardware}, where the model's matmuls measured "
                     f"{ratio:.2f}x faster in bf16", evidence, fix_text("unused_bf16"))]
