"""Step rules on communication: the exposed share of the step, and the bandwidth collectives achieved."""

from __future__ import annotations

import statistics

from scalerl.health.thresholds import RULES
from scalerl.health.tree import NOT_MEASURED, OK, Finding
from scalerl.health.view import PROFILE_HINT, StepView
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
    if view.world_size == 1:
        return [finding("achieved_bandwidth", OK, "one rank: no communication")]
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
