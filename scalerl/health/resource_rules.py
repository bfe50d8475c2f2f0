"""Step rules on resources: peak memory per phase, host-device copies, data loading, checkpoint writes."""

from __future__ import annotations

import math

from scalerl.health.thresholds import RULES
from scalerl.health.tree import NOT_MEASURED, OK, Finding
from scalerl.health.view import PROFILE_HINT, StepView
from scalerl.health.wording import finding, fix_text


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
