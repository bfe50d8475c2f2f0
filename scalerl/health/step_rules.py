"""Rules on step metrics: the same checks run by the online monitor (on the metrics every step already
reduces over ranks) and by `scalerl doctor --performance-profiling` (which adds per-rank measurements).

Each rule reads a `StepView` and returns findings for its leaf, "not measured" (with why) when its inputs
are absent. Thresholds, reasons and fixes come from `scalerl.health.thresholds`. Here: communication (the
exposed share of the step, the bandwidth collectives achieved), resources (peak memory per phase,
host-device copies, data loading, checkpoint writes), the training signal (non-finite values and skipped
steps, reward collapse), and the list every step runs; compute load (stragglers, token imbalance,
granularity) lives in `compute_rules`; host RAM, checkpoint cost and memory at the training/generation
switch in `resource_rules`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from scalerl.health.compute_rules import (
    parallel_granularity,
    stragglers,
    token_imbalance,
    unused_bf16,
)
from scalerl.health.expert_rules import expert_load
from scalerl.health.resource_rules import RESOURCE_RULES
from scalerl.health.rollout_rules import rollout_pipeline
from scalerl.health.thresholds import RULES
from scalerl.health.tree import (
    FAULT,
    NOT_MEASURED,
    OK,
    PROFILE_HINT,
    WARNING,
    Finding,
    StepView,
)
from scalerl.health.wording import finding, fix_text, ratio_text
from scalerl.health.wording import rate as rate_text


def comm_share(view: StepView) -> list[Finding]:
    threshold = RULES["comm_share"].thresholds["share"]
    if view.world_size == 1:
        return [finding("comm_share", OK, "one rank: no communication")]
    if view.per_rank and all("comm_s" in r for r in view.per_rank):
        comm = statistics.mean(r["comm_s"] for r in view.per_rank)
        step = statistics.mean(r["step_s"] for r in view.per_rank)
        how = "mean over ranks of the time in collectives after every peer arrived"
    else:
        waits = [k for k in view.metrics if k.startswith("timing_s/comm/") and k.count("/") == 2]
        if not waits or "timing_s/step" not in view.metrics:
            return [finding("comm_share", NOT_MEASURED, "no time-in-collectives metrics (timing_s/comm/*, comm "
                             f"accounting) in the step metrics; {PROFILE_HINT}")]
        # The rank that waits least arrived last: its wait is the transfer, not waiting for peers.
        comm = sum(view.metrics.get(f"{k}/min", view.metrics[k]) for k in waits)
        step = view.metrics["timing_s/step"]
        how = "sum over kinds of the least any rank waited (timing_s/comm/<kind>/min)"
    share = comm / step if step > 0 else 0.0
    floor = RULES["comm_share"].thresholds["min_s"]
    status = threshold.status(share) if floor.status(comm) != OK else OK
    note = f", under the {floor.warning:g} s per step that counts" if threshold.status(share) != status else ""
    return [finding("comm_share", status, f"exposed communication is {share:.0%} of the step ({comm:.3f} s of "
                     f"{step:.3f} s{note})", {"comm_s": round(comm, 4), "step_s": round(step, 4), "share": round(share, 3),
                                        "how": how}, fix_text("comm_share"))]


def achieved_bandwidth(view: StepView) -> list[Finding]:
    link = view.context.get("link_busbw")
    sent = view.metrics.get("comm/bytes/total")
    # Profiled: the doctor's own time in collectives (after peers arrived) plus DDP's exposed gradient wait,
    # which it cannot see; online: the waits comm accounting measured.
    waited = view.context.get("comm_wait_s")
    if waited is None:
        waited = sum(v for k, v in view.metrics.items() if k.startswith("timing_s/comm/") and k.count("/") == 2)
    if view.world_size == 1:  # said apart from comm_share's line, which sits beside it in the tree
        return [finding("achieved_bandwidth", OK, "one rank: no link to measure")]
    if sent is None:
        return [finding("achieved_bandwidth", NOT_MEASURED, "no per-rank byte counts (comm/bytes/*, comm "
                         "accounting) in the step metrics")]
    if not link or waited <= 0:
        return [finding("achieved_bandwidth", NOT_MEASURED, "needs a measured link busbw and time waited in "
                         f"collectives; {PROFILE_HINT}")]
    rate = sent / waited
    ratio = rate / link
    floor = RULES["achieved_bandwidth"].thresholds["min_s"]
    if floor.status(waited) == OK:
        return [finding("achieved_bandwidth", OK, f"{waited:.3f} s per step in collectives, under the "
                        f"{floor.warning:g} s that says anything about bandwidth ({rate_text(rate)} per rank)",
                        {"bytes_per_rank": sent, "wait_s": round(waited, 4)})]
    status = RULES["achieved_bandwidth"].thresholds["achieved_vs_link"].status(ratio)
    return [finding("achieved_bandwidth", status, f"collectives moved {rate_text(rate)} per rank while "
                     f"waited on, {ratio_text(ratio)} of the measured all-reduce busbw {rate_text(link)}",
                     {"bytes_per_rank": sent, "wait_s": round(waited, 4), "ratio": round(ratio, 3)},
                     fix_text("achieved_bandwidth"))]


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
        peaks = [p.get("peak_gb", 0.0) for r in view.per_rank if r["rank"] == worst_rank for p in r["phases"].values()]
        if peaks and (max(peaks) - min(peaks)) <= 0.02 * max(peaks):  # e.g. a CPU process's resident baseline
            worst_phase = "every phase alike"
        where = f"rank {worst_rank}, in {worst_phase}"
    elif "perf/max_memory_gb" in view.metrics and view.context.get("memory_capacity_gb"):
        worst_cap = view.context["memory_capacity_gb"]
        peak = view.metrics["perf/max_memory_gb"] * view.context.get("ranks_sharing_memory", 1)
        worst, worst_rank, worst_phase = peak / worst_cap, None, "the step (phases are measured when profiled)"
        where = "the busiest rank"
    else:
        return [finding("memory_peak", NOT_MEASURED, "no peak memory with a known capacity")]
    status = threshold.status(worst)
    evidence = {"peak_gb": round(peak, 3), "capacity_gb": round(worst_cap, 3), "fraction": round(worst, 3),
                "phase": worst_phase, "device": view.context.get("device", "")}
    return [finding("memory_peak", status, f"peak memory {peak:.2f} of {worst_cap:.2f} GiB ({worst:.0%}) at {where}",
                     evidence, fix_text("memory_peak", phase=worst_phase),
                     ranks=[worst_rank] if worst_rank is not None and status != OK else [])]


def host_device_share(view: StepView) -> list[Finding]:
    if view.context.get("device", "cpu") == "cpu":
        return [finding("host_device_share", NOT_MEASURED, "CPU run: there is no host-device link")]
    if not view.per_rank or not all("copy_s" in r for r in view.per_rank):
        return [finding("host_device_share", NOT_MEASURED, "copy time comes from torch.profiler; " + PROFILE_HINT)]
    worst = max(view.per_rank, key=lambda r: r["copy_s"] / r["step_s"] if r["step_s"] else 0)
    share = worst["copy_s"] / worst["step_s"] if worst["step_s"] else 0.0
    status = RULES["host_device_share"].thresholds["share"].status(share)
    return [finding("host_device_share", status, f"host<->device copies take {share:.0%} of the step on rank "
                     f"{worst['rank']} ({worst['copy_s']:.4f} s)", {"copy_s": worst["copy_s"], "share": round(share, 3)},
                     fix_text("host_device_share"), ranks=[worst["rank"]] if status != OK else [])]


def data_wait(view: StepView) -> list[Finding]:
    threshold = RULES["data_wait"].thresholds["share"]
    if view.per_rank and all("data" in r.get("phases", {}) for r in view.per_rank):
        worst = max(view.per_rank, key=lambda r: r["phases"]["data"]["busy_s"] / max(r["step_s"], 1e-9))
        data, step, rank = worst["phases"]["data"]["busy_s"], worst["step_s"], worst["rank"]
    elif "timing_s/data" in view.metrics and view.metrics.get("timing_s/step"):
        data, step = view.metrics.get("timing_s/data/max", view.metrics["timing_s/data"]), view.metrics["timing_s/step"]
        rank = None
    else:
        return [finding("data_wait", NOT_MEASURED, "no data-loading time (timing_s/data) in the step metrics")]
    share = data / step if step > 0 else 0.0
    floor = RULES["data_wait"].thresholds["min_s"]
    status = threshold.status(share) if floor.status(data) != OK else OK
    note = f", under the {floor.warning:g} s per step that counts" if threshold.status(share) != status else ""
    who = f" on rank {rank}" if rank is not None else ""
    return [finding("data_wait", status, f"fetching and encoding prompts takes {share:.0%} of the step{who} "
                     f"({data:.3f} s of {step:.3f} s{note})", {"data_s": round(data, 4), "step_s": round(step, 4),
                                                         "share": round(share, 3)},
                     fix_text("data_wait"), ranks=[rank] if rank is not None and status != OK else [])]


def checkpoint_interval(view: StepView) -> list[Finding]:
    c = view.context
    if not all(k in c for k in ("checkpoint_bytes", "write_bytes_per_s", "save_every")):
        return [finding("checkpoint_interval", NOT_MEASURED, "needs the checkpoint size and the write speed at the "
                         f"checkpoint path; {PROFILE_HINT}")]
    out = []
    save_s = c["checkpoint_bytes"] / c["write_bytes_per_s"]
    step = view.metrics.get("timing_s/step", 0.0)
    evidence = {"checkpoint_gb": round(c["checkpoint_bytes"] / 2**30, 4), "write_mb_s": round(c["write_bytes_per_s"] / 2**20, 1),
                "save_s": round(save_s, 3), "save_every": c["save_every"], "step_s": round(step, 4)}
    if c["save_every"] == 0 or step <= 0:
        out.append(finding("checkpoint_interval", OK, f"a checkpoint takes about {save_s:.2f} s to write; saved only "
                            "at the end (trainer.save_every=0)", evidence))
    else:
        share = save_s / (c["save_every"] * step)
        status = RULES["checkpoint_interval"].thresholds["share"].status(share)
        suggestion = math.ceil(save_s / (0.1 * step))
        out.append(finding("checkpoint_interval", status, f"writing a checkpoint (~{save_s:.2f} s) costs {share:.0%} "
                            f"of the {c['save_every']} steps between checkpoints", {**evidence, "share": round(share, 3)},
                            fix_text("checkpoint_interval", suggestion=suggestion)))
    if "free_bytes" in c:
        needed = c["checkpoint_bytes"] * (int(c.get("keep_last", 1)) + 1)
        ratio = c["free_bytes"] / needed if needed else math.inf
        status = RULES["disk_space"].thresholds["free_over_needed"].status(ratio)
        out.append(finding("disk_space", status, f"{c['free_bytes'] / 2**30:.1f} GiB free for {needed / 2**30:.3f} GiB "
                            f"of checkpoints (keep_last={c.get('keep_last', 1)} + the one being written)",
                            {"free_gb": round(c["free_bytes"] / 2**30, 2), "needed_gb": round(needed / 2**30, 4)},
                            fix_text("disk_space", path=c.get("checkpoint_path", "the checkpoint path"))))
    return out


SKIPPED_STEP_METRICS = ("actor/skipped_steps", "critic/skipped_steps", "sft/skipped_steps")


def non_finite(view: StepView) -> list[Finding]:
    bad = sorted(k for k, v in view.metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        return [finding("non_finite", FAULT, f"non-finite values: {', '.join(bad[:6])}", {"metrics": bad},
                         fix_text("non_finite"))]
    skipped = {k: view.metrics[k] for k in SKIPPED_STEP_METRICS if view.metrics.get(k, 0) > 0}
    if skipped:
        return [finding("non_finite", WARNING, "optimizer steps skipped for non-finite gradients: " +
                         ", ".join(f"{k}={v:g}" for k, v in skipped.items()), skipped, fix_text("non_finite"))]
    return [finding("non_finite", OK, "every metric finite, no skipped steps")]


def reward_collapse(history: list[dict[str, float]]) -> list[Finding]:
    """``history``: ``critic/score/{mean,max,min}`` of each step so far, oldest first."""
    rule = RULES["reward_collapse"]
    flat_n = int(rule.thresholds["flat_steps"].warning)
    scored = [h for h in history if "critic/score/mean" in h]
    if not scored:
        return [finding("reward_collapse", NOT_MEASURED, "no rewards in these steps (SFT has none)")]
    if len(scored) < flat_n:
        return [finding("reward_collapse", NOT_MEASURED, f"{len(scored)} step(s) with rewards so far; needs "
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
        return [finding("reward_collapse", WARNING, f"every sample scored {recent[-1]['critic/score/mean']:g} in the "
                         f"last {flat_n} steps: GRPO advantages are all 0", evidence, fix)]
    window = 3
    means = [h["critic/score/mean"] for h in scored]
    averages = [statistics.mean(means[i:i + window]) for i in range(len(means) - window + 1)]
    best, now = max(averages), averages[-1]
    drop = (best - now) / abs(best) if best else 0.0
    evidence.update(best_window_mean=round(best, 4), window_mean=round(now, 4), drop=round(drop, 3))
    status = rule.thresholds["drop_from_best"].status(drop)
    cause, fix = collapse_cause(scored, averages.index(best), window)
    if cause:
        evidence["cause"] = cause
    fix += "; resume from a checkpoint before the drop (trainer.resume=<checkpoint dir>)"
    return [finding("reward_collapse", status, f"mean reward over the last {window} steps {now:.4g}, best "
                     f"{best:.4g} ({drop:.0%} below it){': ' + cause if cause and status != OK else ''}",
                     evidence, fix)]


# What the monitor keeps of each step besides the reward, to name a collapse's cause (`collapse_cause`).
TRAJECTORY_KEYS = ("actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/lr")


def collapse_cause(history: list[dict[str, float]], best_start: int, window: int) -> tuple[str, str]:
    """Why the reward fell, read from the training trajectory: the steps of the best reward window against the
    steps since. A cause and its fix: the entropy collapsed (the policy stopped exploring) or blew up (it
    went random), the gradient norm spiked, the updates moved the policy too far per step (KL to the
    previous policy, clip fraction), or the learning rate rose into the drop; none found: the generic fix."""
    before = history[best_start : best_start + window]
    after = history[best_start + window :] or history[-window:]

    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return statistics.mean(values) if values else None

    def peak(rows, key):
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None

    entropy_then, entropy_now = mean(before, "actor/entropy"), mean(after, "actor/entropy")
    grad_then, grad_peak = mean(before, "actor/grad_norm"), peak(after, "actor/grad_norm")
    kl_now, clip_now = mean(after, "actor/ppo_kl"), mean(after, "actor/pg_clipfrac")
    lr_then, lr_now = mean(before, "actor/lr"), mean(after, "actor/lr")
    if grad_then and grad_peak is not None and grad_peak > 10 * grad_then:
        return (f"the gradient norm spiked to {grad_peak:.3g} ({grad_peak / grad_then:.0f}x its {grad_then:.3g} at the "
                "best steps)", "lower actor.lr and keep actor.grad_clip > 0 (the spike is the step that broke it)")
    if lr_then and lr_now is not None and lr_now > 2 * lr_then:
        return (f"the learning rate rose from {lr_then:.3g} to {lr_now:.3g} into the drop (the warmup or schedule)",
                "lower actor.lr (the peak the schedule reaches), or lengthen actor.warmup_steps")
    if entropy_then and entropy_now is not None and entropy_now < 0.3 * entropy_then:
        return (f"the entropy collapsed from {entropy_then:.3g} to {entropy_now:.3g}: the policy stopped exploring",
                "keep it exploring: actor.entropy_coeff > 0, rollout.temperature, DAPO's clip-higher "
                "(actor.clip_ratio_high=0.28)")
    if entropy_then and entropy_now is not None and entropy_now > 2 * entropy_then:
        return (f"the entropy rose from {entropy_then:.3g} to {entropy_now:.3g}: the policy is falling apart into "
                "noise", "lower actor.lr; a KL penalty to the reference (actor.use_kl_loss=true, actor.kl_loss_coef)")
    if (kl_now is not None and kl_now > 0.05) or (clip_now is not None and clip_now > 0.3):
        return ("each update moves the policy far (KL to the previous policy "
                f"{kl_now if kl_now is not None else float('nan'):.3g}, clip fraction "
                f"{clip_now if clip_now is not None else float('nan'):.2f})",
                "smaller updates: lower actor.lr, fewer actor.ppo_epochs, or a KL penalty (actor.use_kl_loss=true)")
    return "", ("lower actor.lr; add a KL penalty (actor.use_kl_loss=true, actor.kl_loss_coef)")


MISMATCH_KEY = "rollout/logprob_diff/mean"


def logprob_mismatch(history: list[dict[str, float]], context: dict | None = None) -> list[Finding]:
    """``history``: ``rollout/logprob_diff/mean`` of each step so far, oldest first (present only where the
    trainer recomputes old log-probs instead of reusing the engine's). The level over the last steps and its
    growth from the first ones, each against its threshold; the fix names the run's correction settings."""
    rule, context = RULES["logprob_mismatch"], context or {}
    diffs = [h[MISMATCH_KEY] for h in history if MISMATCH_KEY in h]
    if not diffs:
        return [finding("logprob_mismatch", NOT_MEASURED, "the trainer reuses the engine's log-probs (they equal its "
                        "own forward's), so there is no gap to measure")]
    window = min(3, len(diffs))
    now, first = statistics.mean(diffs[-window:]), statistics.mean(diffs[:window])
    growth = now / first if first > 0 and len(diffs) >= 2 * window else 1.0
    level, trend = rule.thresholds["mean"].status(now), rule.thresholds["growth"].status(growth)
    status = max((level, trend), key=lambda s: {OK: 0, WARNING: 1, FAULT: 2}[s])
    evidence = {"recent_mean": round(now, 5), "first_mean": round(first, 5), "growth": round(growth, 2),
                "steps": len(diffs), "rollout.is_cap": context.get("rollout_is_cap"),
                "rollout.is_level": context.get("rollout_is_level"), "rollout.dtype": context.get("rollout_dtype")}
    cap = context.get("rollout_is_cap")
    fix = ("weight the off-policy tokens: rollout.is_cap=2 with rollout.is_level=token (verl's TIS) or "
           "rollout.is_mode=mask (MIS)" if not cap else
           f"the correction is on (rollout.is_cap={cap:g}); lower the cap or use rollout.is_mode=mask to drop the "
           "tokens that disagree most")
    fix += ("; compute the engine in the trainer's precision (rollout.dtype, trainer.precision) so the two forwards "
            "agree; for MoE models, fewer router flips (routing replay is not in scalerl yet)")
    grew = f", {growth:.2g}x its first steps'" if growth != 1.0 else ""
    return [finding("logprob_mismatch", status, f"the trainer's log-probs differ from the engine's by {now:.3g} nats "
                    f"per token over the last {window} steps{grew}", evidence, fix if status != OK else "")]


__all__ = ["STEP_RULES", "StepView", "logprob_mismatch", "reward_collapse", "run_step_rules"]

STEP_RULES: tuple[Callable[[StepView], list[Finding]], ...] = (
    stragglers, token_imbalance, parallel_granularity, comm_share, achieved_bandwidth, memory_peak,
    host_device_share, data_wait, checkpoint_interval, non_finite, expert_load, rollout_pipeline, unused_bf16,
    *RESOURCE_RULES,
)


def run_step_rules(view: StepView, reward_history: list[dict[str, float]] | None = None,
                   mismatch_history: list[dict[str, float]] | None = None) -> list[Finding]:
    """Every step rule's findings for ``view`` (and the reward and log-prob mismatch histories, when given)."""
    findings = [f for rule in STEP_RULES for f in rule(view)]
    if reward_history is not None:
        findings += reward_collapse(reward_history)
    if mismatch_history is not None:
        findings += logprob_mismatch(mismatch_history, view.context)
    return findings
