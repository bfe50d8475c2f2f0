"""Rules on step metrics: the same checks run by the online monitor (on the metrics every step already
reduces over ranks) and by `scalerl doctor --performance-profiling` (which adds per-rank measurements).

Each rule reads a `StepView` and returns findings for its leaf, "not measured" (with why) when its inputs
are absent. Thresholds, reasons and fixes come from `scalerl.perf.health.thresholds`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from scalerl.perf.health.thresholds import RULES
from scalerl.perf.health.tree import FAULT, NOT_MEASURED, OK, WARNING, Finding

PROFILE_HINT = "scalerl doctor --performance-profiling CONFIG measures it"


@dataclass
class StepView:
    """What the step rules read.

    ``metrics``: one step's metrics reduced over ranks (the trainer's names; spreads as ``<name>/max``...).
    ``per_rank``: when profiled, one dict per rank: ``rank``, ``host``, ``step_s``, ``busy_s`` (own work) and
    ``busy_by_step``, ``wait_s`` (blocked on peers and in collectives), ``comm_s`` (in collectives after peers arrived),
    ``update_tokens``, ``copy_s``, ``phases`` ({phase: {time_s, busy_s, wait_s, peak_gb}}), ``capacity_gb``.
    ``context``: facts from the config and the machine (see each rule).
    """

    metrics: dict[str, float]
    per_rank: list[dict[str, Any]] | None = None
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.context.get("world_size", len(self.per_rank) if self.per_rank else 1))


def _finding(rule_id: str, status: str, summary: str, evidence: dict | None = None, fix: str = "",
             ranks=(), hosts=()) -> Finding:
    return Finding(RULES[rule_id].leaf, rule_id, status, summary, evidence or {},
                   fix if status in (WARNING, FAULT) else "", tuple(ranks), tuple(hosts))


def _fix(rule_id: str, **values: Any) -> str:
    return RULES[rule_id].fix.format(**values)


def _ratio_text(x: float) -> str:
    return f"{x:.0%}" if x < 10 else f"{x:.1f}x"


# ----------------------------------------------------------------------------------------- compute load
def stragglers(view: StepView) -> list[Finding]:
    rule = RULES["stragglers"]
    ratio_t, excess_t = rule.thresholds["busy_over_median"], rule.thresholds["excess_s"]
    if view.world_size == 1:
        return [_finding("stragglers", OK, "one rank: nothing to wait for")]
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
        return [_finding("stragglers", NOT_MEASURED,
                         "needs each rank's time blocked in collectives (timing_s/comm/*, comm accounting) to "
                         f"tell a slow rank from the ranks waiting for it; {PROFILE_HINT}")]
    excess = busy[slowest] - median
    ratio = busy[slowest] / median if median > 0 else math.inf
    evidence = {"busy_s_by_rank": {str(k): round(v, 4) for k, v in busy.items()}, f"{basis}_busy_s": round(median, 4),
                "slowest_rank": slowest, "ratio": round(ratio, 3), "step_s": round(step, 4)}
    steady = _slowest_share(view.per_rank, slowest) if view.per_rank else None
    if steady is not None:
        evidence["slowest_in_steps"] = round(steady, 3)
    noise = excess < max(excess_t.warning, 0.05 * step) or \
        (steady is not None and rule.thresholds["slowest_in_steps"].status(steady) == OK)
    status = OK if noise else ratio_t.status(ratio)
    host = next((r.get("host", "") for r in view.per_rank or () if r["rank"] == slowest), "")
    phase = _dominant_phase(view.per_rank, slowest) if view.per_rank else "(per-rank phases need profiling)"
    if status == OK:
        return [_finding("stragglers", OK, f"slowest rank {slowest} works {ratio:.2f}x the {basis} rank "
                         f"({busy[slowest]:.3f} s vs {median:.3f} s per step)", evidence)]
    explained = _explained_by_tokens(view, slowest)
    if explained:
        evidence["explained_by"] = explained
        return [_finding("stragglers", OK, f"rank {slowest} works {ratio:.2f}x the {basis} rank because it "
                         f"holds the most tokens ({explained}): see data sharding imbalance", evidence, ranks=[slowest])]
    evidence["phase"] = phase
    return [_finding("stragglers", status,
                     f"rank {slowest}{f' on {host}' if host else ''} works {ratio:.2f}x the {basis} rank "
                     f"({busy[slowest]:.3f} s vs {median:.3f} s per step, most of it in {phase}); every other "
                     f"rank waits for it", evidence,
                     _fix("stragglers", ranks=slowest, hosts=host or "its node", phase=phase),
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
        return [_finding("token_imbalance", OK, "one data-parallel rank: nothing to balance")]
    if view.per_rank and all("update_tokens" in r for r in view.per_rank):
        tokens = {r["rank"]: r["update_tokens"] for r in view.per_rank}
        mean, top = statistics.mean(tokens.values()), max(tokens.values())
        evidence: dict[str, Any] = {"update_tokens_by_rank": {str(k): v for k, v in tokens.items()}}
    elif "perf/update_tokens/max" in view.metrics:
        mean, top = view.metrics["perf/update_tokens"], view.metrics["perf/update_tokens/max"]
        evidence = {"update_tokens_mean": mean, "update_tokens_max": top}
    else:
        return [_finding("token_imbalance", NOT_MEASURED, "no per-rank token counts (perf/update_tokens) in the "
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
    return [_finding("token_imbalance", status, f"the busiest data-parallel rank updates on {ratio:.2f}x the mean "
                     f"token count {where}", evidence, fix)]


def parallel_granularity(view: StepView) -> list[Finding]:
    c = view.context
    out = []
    tp = int(c.get("tp", 1))
    if tp == 1:
        out.append(_finding("tp_granularity", OK, "no tensor parallelism (parallel.tp=1)"))
    elif not all(k in c for k in ("hidden_size", "layer_params", "dtype_bytes", "peak_flops", "link_busbw")):
        out.append(_finding("tp_granularity", NOT_MEASURED, "needs the model size, the device peak and a measured "
                            f"link busbw; {PROFILE_HINT}"))
    else:
        # Per layer and token: 4 all-reduces of the hidden state (2 forward, 2 backward), each moving
        # 2(tp-1)/tp x hidden x bytes at busbw, against 6 x layer params / tp FLOPs at the device's peak.
        comm = 4 * 2 * (tp - 1) / tp * c["hidden_size"] * c["dtype_bytes"] / c["link_busbw"]
        compute = 6 * c["layer_params"] / tp / c["peak_flops"]
        ratio = comm / compute
        status = RULES["tp_granularity"].thresholds["comm_over_compute"].status(ratio)
        evidence = {"tp": tp, "hidden_size": c["hidden_size"], "hidden_per_rank": c["hidden_size"] // tp,
                    "comm_over_compute": round(ratio, 3), "link_busbw_gbytes_s": round(c["link_busbw"] / 1e9, 3),
                    "peak_tflops": round(c["peak_flops"] / 1e12, 3)}
        out.append(_finding("tp_granularity", status, f"parallel.tp={tp} on hidden size {c['hidden_size']}: "
                            f"tensor-parallel communication is an estimated {ratio:.2f}x its compute", evidence,
                            _fix("tp_granularity", suggestion=max(1, tp // 2))))
    pp = int(c.get("pp", 1))
    if pp == 1:
        out.append(_finding("pp_bubble", OK, "no pipeline parallelism (parallel.pp=1)"))
    else:
        m, v = int(c.get("microbatches", 1)), 2 if c.get("pp_schedule") == "interleaved_1f1b" else 1
        bubble = (pp - 1) / (m * v + pp - 1)
        status = RULES["pp_bubble"].thresholds["bubble"].status(bubble)
        out.append(_finding("pp_bubble", status, f"pipeline bubble {bubble:.0%} of each update (pp={pp}, "
                            f"{m} micro-batches, {v} stage(s) per rank)",
                            {"pp": pp, "microbatches": m, "stages_per_rank": v, "bubble": round(bubble, 3)},
                            _fix("pp_bubble", suggestion=math.ceil(3 * (pp - 1) / v))))
    return out


# ----------------------------------------------------------------------------------------- communication
def comm_share(view: StepView) -> list[Finding]:
    threshold = RULES["comm_share"].thresholds["share"]
    if view.world_size == 1:
        return [_finding("comm_share", OK, "one rank: no communication")]
    if view.per_rank and all("comm_s" in r for r in view.per_rank):
        comm = statistics.mean(r["comm_s"] for r in view.per_rank)
        step = statistics.mean(r["step_s"] for r in view.per_rank)
        how = "mean over ranks of the time in collectives after every peer arrived"
    else:
        waits = [k for k in view.metrics if k.startswith("timing_s/comm/") and k.count("/") == 2]
        if not waits or "timing_s/step" not in view.metrics:
            return [_finding("comm_share", NOT_MEASURED, "no time-in-collectives metrics (timing_s/comm/*, comm "
                             f"accounting) in the step metrics; {PROFILE_HINT}")]
        # The rank that waits least arrived last: its wait is the transfer, not waiting for peers.
        comm = sum(view.metrics.get(f"{k}/min", view.metrics[k]) for k in waits)
        step = view.metrics["timing_s/step"]
        how = "sum over kinds of the least any rank waited (timing_s/comm/<kind>/min)"
    share = comm / step if step > 0 else 0.0
    status = threshold.status(share) if RULES["comm_share"].thresholds["min_s"].status(comm) != OK else OK
    return [_finding("comm_share", status, f"exposed communication is {share:.0%} of the step ({comm:.3f} s of "
                     f"{step:.3f} s)", {"comm_s": round(comm, 4), "step_s": round(step, 4), "share": round(share, 3),
                                        "how": how}, _fix("comm_share"))]


def achieved_bandwidth(view: StepView) -> list[Finding]:
    link = view.context.get("link_busbw")
    sent = view.metrics.get("comm/bytes/total")
    waited = sum(v for k, v in view.metrics.items() if k.startswith("timing_s/comm/") and k.count("/") == 2)
    if view.world_size == 1:
        return [_finding("achieved_bandwidth", OK, "one rank: no communication")]
    if sent is None:
        return [_finding("achieved_bandwidth", NOT_MEASURED, "no per-rank byte counts (comm/bytes/*, comm "
                         "accounting) in the step metrics")]
    if not link or waited <= 0:
        return [_finding("achieved_bandwidth", NOT_MEASURED, "needs a measured link busbw and time waited in "
                         f"collectives; {PROFILE_HINT}")]
    rate = sent / waited
    ratio = rate / link
    status = RULES["achieved_bandwidth"].thresholds["achieved_vs_link"].status(ratio)
    return [_finding("achieved_bandwidth", status, f"collectives moved {rate / 1e9:.3f} GB/s per rank while "
                     f"waited on, {_ratio_text(ratio)} of the measured all-reduce busbw {link / 1e9:.3f} GB/s",
                     {"bytes_per_rank": sent, "wait_s": round(waited, 4), "ratio": round(ratio, 3)},
                     _fix("achieved_bandwidth"))]


# ----------------------------------------------------------------------------------------- resources
def memory_peak(view: StepView) -> list[Finding]:
    threshold = RULES["memory_peak"].thresholds["fraction"]
    if view.per_rank and all("capacity_gb" in r and r.get("phases") for r in view.per_rank):
        worst, worst_rank, worst_phase, worst_cap = -1.0, 0, "", 0.0
        for r in view.per_rank:
            for phase, stats in r["phases"].items():
                frac = stats.get("peak_gb", 0.0) / r["capacity_gb"]
                if frac > worst:
                    worst, worst_rank, worst_phase, worst_cap = frac, r["rank"], phase, r["capacity_gb"]
        peak = worst * worst_cap
        where = f"rank {worst_rank}, in {worst_phase}"
    elif "perf/max_memory_gb" in view.metrics and view.context.get("memory_capacity_gb"):
        worst_cap = view.context["memory_capacity_gb"]
        peak = view.metrics["perf/max_memory_gb"] * view.context.get("ranks_sharing_memory", 1)
        worst, worst_rank, worst_phase = peak / worst_cap, None, "the step (phases are measured when profiled)"
        where = "the busiest rank"
    else:
        return [_finding("memory_peak", NOT_MEASURED, "no peak memory with a known capacity")]
    status = threshold.status(worst)
    evidence = {"peak_gb": round(peak, 3), "capacity_gb": round(worst_cap, 3), "fraction": round(worst, 3),
                "phase": worst_phase, "device": view.context.get("device", "")}
    return [_finding("memory_peak", status, f"peak memory {peak:.2f} of {worst_cap:.2f} GiB ({worst:.0%}) at {where}",
                     evidence, _fix("memory_peak", phase=worst_phase),
                     ranks=[worst_rank] if worst_rank is not None and status != OK else [])]


def host_device_share(view: StepView) -> list[Finding]:
    if view.context.get("device", "cpu") == "cpu":
        return [_finding("host_device_share", NOT_MEASURED, "CPU run: there is no host-device link")]
    if not view.per_rank or not all("copy_s" in r for r in view.per_rank):
        return [_finding("host_device_share", NOT_MEASURED, "copy time comes from torch.profiler; " + PROFILE_HINT)]
    worst = max(view.per_rank, key=lambda r: r["copy_s"] / r["step_s"] if r["step_s"] else 0)
    share = worst["copy_s"] / worst["step_s"] if worst["step_s"] else 0.0
    status = RULES["host_device_share"].thresholds["share"].status(share)
    return [_finding("host_device_share", status, f"host<->device copies take {share:.0%} of the step on rank "
                     f"{worst['rank']} ({worst['copy_s']:.4f} s)", {"copy_s": worst["copy_s"], "share": round(share, 3)},
                     _fix("host_device_share"), ranks=[worst["rank"]] if status != OK else [])]


def data_wait(view: StepView) -> list[Finding]:
    threshold = RULES["data_wait"].thresholds["share"]
    if view.per_rank and all("data" in r.get("phases", {}) for r in view.per_rank):
        worst = max(view.per_rank, key=lambda r: r["phases"]["data"]["busy_s"] / max(r["step_s"], 1e-9))
        data, step, rank = worst["phases"]["data"]["busy_s"], worst["step_s"], worst["rank"]
    elif "timing_s/data" in view.metrics and view.metrics.get("timing_s/step"):
        data, step = view.metrics.get("timing_s/data/max", view.metrics["timing_s/data"]), view.metrics["timing_s/step"]
        rank = None
    else:
        return [_finding("data_wait", NOT_MEASURED, "no data-loading time (timing_s/data) in the step metrics")]
    share = data / step if step > 0 else 0.0
    status = threshold.status(share) if RULES["data_wait"].thresholds["min_s"].status(data) != OK else OK
    who = f" on rank {rank}" if rank is not None else ""
    return [_finding("data_wait", status, f"fetching and encoding prompts takes {share:.0%} of the step{who} "
                     f"({data:.3f} s of {step:.3f} s)", {"data_s": round(data, 4), "step_s": round(step, 4),
                                                         "share": round(share, 3)},
                     _fix("data_wait"), ranks=[rank] if rank is not None and status != OK else [])]


def checkpoint_interval(view: StepView) -> list[Finding]:
    c = view.context
    if not all(k in c for k in ("checkpoint_bytes", "write_bytes_per_s", "save_every")):
        return [_finding("checkpoint_interval", NOT_MEASURED, "needs the checkpoint size and the write speed at the "
                         f"checkpoint path; {PROFILE_HINT}")]
    out = []
    save_s = c["checkpoint_bytes"] / c["write_bytes_per_s"]
    step = view.metrics.get("timing_s/step", 0.0)
    evidence = {"checkpoint_gb": round(c["checkpoint_bytes"] / 2**30, 4), "write_mb_s": round(c["write_bytes_per_s"] / 2**20, 1),
                "save_s": round(save_s, 3), "save_every": c["save_every"], "step_s": round(step, 4)}
    if c["save_every"] == 0 or step <= 0:
        out.append(_finding("checkpoint_interval", OK, f"a checkpoint takes about {save_s:.2f} s to write; saved only "
                            "at the end (trainer.save_every=0)", evidence))
    else:
        share = save_s / (c["save_every"] * step)
        status = RULES["checkpoint_interval"].thresholds["share"].status(share)
        suggestion = math.ceil(save_s / (0.1 * step))
        out.append(_finding("checkpoint_interval", status, f"writing a checkpoint (~{save_s:.2f} s) costs {share:.0%} "
                            f"of the {c['save_every']} steps between checkpoints", {**evidence, "share": round(share, 3)},
                            _fix("checkpoint_interval", suggestion=suggestion)))
    if "free_bytes" in c:
        needed = c["checkpoint_bytes"] * (int(c.get("keep_last", 1)) + 1)
        ratio = c["free_bytes"] / needed if needed else math.inf
        status = RULES["disk_space"].thresholds["free_over_needed"].status(ratio)
        out.append(_finding("disk_space", status, f"{c['free_bytes'] / 2**30:.1f} GiB free for {needed / 2**30:.3f} GiB "
                            f"of checkpoints (keep_last={c.get('keep_last', 1)} + the one being written)",
                            {"free_gb": round(c["free_bytes"] / 2**30, 2), "needed_gb": round(needed / 2**30, 4)},
                            _fix("disk_space", path=c.get("checkpoint_path", "the checkpoint path"))))
    return out


# ----------------------------------------------------------------------------------------- training signal
SKIPPED_STEP_METRICS = ("actor/skipped_steps", "critic/skipped_steps", "sft/skipped_steps")


def non_finite(view: StepView) -> list[Finding]:
    bad = sorted(k for k, v in view.metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        return [_finding("non_finite", FAULT, f"non-finite values: {', '.join(bad[:6])}", {"metrics": bad},
                         _fix("non_finite"))]
    skipped = {k: view.metrics[k] for k in SKIPPED_STEP_METRICS if view.metrics.get(k, 0) > 0}
    if skipped:
        return [_finding("non_finite", WARNING, "optimizer steps skipped for non-finite gradients: " +
                         ", ".join(f"{k}={v:g}" for k, v in skipped.items()), skipped, _fix("non_finite"))]
    return [_finding("non_finite", OK, "every metric finite, no skipped steps")]


def reward_collapse(history: list[dict[str, float]]) -> list[Finding]:
    """``history``: ``critic/score/{mean,max,min}`` of each step so far, oldest first."""
    rule = RULES["reward_collapse"]
    flat_n = int(rule.thresholds["flat_steps"].warning)
    scored = [h for h in history if "critic/score/mean" in h]
    if len(scored) < flat_n:
        return [_finding("reward_collapse", NOT_MEASURED, f"{len(scored)} step(s) with rewards so far; needs "
                         f"{flat_n} (the monitor watches it during training: trainer.monitor_every)")]
    recent = scored[-flat_n:]
    evidence = {"recent_mean": [round(h["critic/score/mean"], 4) for h in recent]}
    if all(h["critic/score/max"] - h["critic/score/min"] <= 1e-9 for h in recent):
        top = max(h["critic/score/max"] for h in scored)
        saturated = recent[-1]["critic/score/max"] >= top and any(h["critic/score/max"] > h["critic/score/min"] for h in scored)
        if saturated:
            fix = "every sample earns the top reward: give it harder prompts (e.g. data.difficulty=[3,4])"
        else:
            fix = ("check data.reward on a few responses (scalerl generate); start from an SFT model "
                   "(trainer.init_from); more diverse samples: rollout.n, rollout.temperature")
        return [_finding("reward_collapse", WARNING, f"every sample scored {recent[-1]['critic/score/mean']:g} in the "
                         f"last {flat_n} steps: GRPO advantages are all 0", evidence, fix)]
    window = 3
    means = [h["critic/score/mean"] for h in scored]
    averages = [statistics.mean(means[i:i + window]) for i in range(len(means) - window + 1)]
    best, now = max(averages), averages[-1]
    drop = (best - now) / abs(best) if best else 0.0
    evidence.update(best_window_mean=round(best, 4), window_mean=round(now, 4), drop=round(drop, 3))
    status = rule.thresholds["drop_from_best"].status(drop)
    fix = ("lower actor.lr; add a KL penalty (actor.use_kl_loss=true, actor.kl_loss_coef); resume from a "
           "checkpoint before the drop (trainer.resume=<checkpoint dir>)")
    return [_finding("reward_collapse", status, f"mean reward over the last {window} steps {now:.4g}, best "
                     f"{best:.4g} ({drop:.0%} below it)", evidence, fix)]


STEP_RULES: tuple[Callable[[StepView], list[Finding]], ...] = (
    stragglers, token_imbalance, parallel_granularity, comm_share, achieved_bandwidth, memory_peak,
    host_device_share, data_wait, checkpoint_interval, non_finite,
)


def run_step_rules(view: StepView, reward_history: list[dict[str, float]] | None = None) -> list[Finding]:
    """Every step rule's findings for ``view`` (and the reward history, when given)."""
    findings = [f for rule in STEP_RULES for f in rule(view)]
    if reward_history is not None:
        findings += reward_collapse(reward_history)
    return findings
