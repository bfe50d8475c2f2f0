"""Step rules on the rollout pipeline: the trainer waiting for standalone workers' rollouts
(``timing_s/trainer_idle``), the workers waiting for requests or weights (``timing_s/rollout_idle``, which
they report with their answers), and the generation long tail (the longest response keeps the batch
decoding: ``response_length/mean`` over ``/max`` where generation is a real share of the step).

Each fix reads the other side: a trainer that waits while the workers idle too has too shallow a pipeline
(more ``rollout.staleness``); one that waits on busy workers has too little generation (more
``rollout.workers``, more rows decoding at once); workers that idle while the trainer does not have more
capacity than the update uses (fewer workers). The context gives ``rollout_placement``,
``rollout_staleness`` and ``rollout_workers`` (`scalerl.health.monitor`).

The weight-sync watchdog's leaf reads the push's slowest step against its limit (``weight_sync/slowest_step_s``,
``weight_sync/timeout_s``) and, when a step overran it, the watchdog's failure record (context
``weight_sync_stall``: `scalerl.comm.weights.watchdog.stall_record`), which names the side, the bucket and the
ranks behind; the fix depends on who is stuck (`stall_finding`).
"""

from __future__ import annotations

from typing import Any

from scalerl.comm.weights.watchdog import stall_message
from scalerl.health.thresholds import RULES
from scalerl.health.tree import FAULT, OK, Finding, StepView
from scalerl.health.wording import finding

TRAINER_IDLE, ROLLOUT_IDLE, STEP = "timing_s/trainer_idle", "timing_s/rollout_idle", "timing_s/step"


def _share(view: StepView, key: str) -> float:
    return view.metrics[key] / max(view.metrics[STEP], 1e-9)


def _knobs(view: StepView) -> tuple[int, int]:
    return int(view.context.get("rollout_staleness", 0)), int(view.context.get("rollout_workers", 1))


def trainer_idle(view: StepView) -> list[Finding]:
    if TRAINER_IDLE not in view.metrics or STEP not in view.metrics:
        return [finding("trainer_idle", OK, "rollouts are generated on the trainer's ranks (colocated): it waits "
                        "for no one")]
    threshold = RULES["trainer_idle"].thresholds["share"]
    share, workers_share = _share(view, TRAINER_IDLE), _share(view, ROLLOUT_IDLE) if ROLLOUT_IDLE in view.metrics else 0.0
    staleness, workers = _knobs(view)
    status = threshold.status(share)
    evidence = {"trainer_idle_s": round(view.metrics[TRAINER_IDLE], 4), "step_s": round(view.metrics[STEP], 4),
                "share": round(share, 3), "rollout_idle_share": round(workers_share, 3),
                "rollout.staleness": staleness, "rollout.workers": workers}
    if staleness == 0:
        fix = ("rollout.staleness=1 (or more) lets the next steps generate while this one trains; the samples "
               "are then corrected per rollout.is_level / is_mode")
    elif workers_share > RULES["rollout_idle"].thresholds["share"].warning:
        fix = (f"the workers wait too: the pipeline is too shallow, raise rollout.staleness (now {staleness}) so "
               "requests queue at the workers instead of the trainer")
    else:
        fix = (f"generation is the bottleneck (the workers are busy): add rollout workers (rollout.workers, now "
               f"{workers}), decode more rows at once (rollout.max_num_seqs with the continuous-batching engine), "
               f"or raise rollout.staleness (now {staleness}) to absorb steps whose generation runs long")
    if status != OK and workers > 1:
        fix += _streaming_advice(view, evidence)
    return [finding("trainer_idle", status, f"the trainer waited {view.metrics[TRAINER_IDLE]:.3g} s for rollouts, "
                    f"{share:.0%} of its {view.metrics[STEP]:.3g} s step", evidence, fix)]


def _streaming_advice(view: StepView, evidence: dict) -> str:
    """With several workers the trainer can work on the parts that came while the rest generate
    (rollout.stream_groups); where that is on, whether the micro-batches let it (a micro-batch spanning two
    workers' parts waits for both, so one larger than a part leaves only the scoring to overlap), and why the
    update's mini-batches wait for the whole batch where the trainer found a reason (``stream_update_waits_for``)."""
    if not view.context.get("rollout_stream_groups"):
        return ("; with several workers, rollout.stream_groups=true scores each worker's part and runs its "
                "log-prob passes as it arrives (it pays with the trainer on its own device)")
    overlap = view.metrics.get("timing_s/stream_overlap", 0.0)
    evidence["stream_overlap_s"] = round(overlap, 4)
    rows, micro = view.context.get("stream_rows_per_worker"), view.context.get("micro_batch")
    waits = view.context.get("stream_update_waits_for")
    update = "" if waits is None else f"; the update's mini-batches wait for the whole batch: {waits}"
    if waits is None and "perf/stream_early_mini_batches" in view.metrics:
        evidence["early_mini_batches"] = view.metrics["perf/stream_early_mini_batches"]
    if rows and micro and micro > rows:
        evidence.update({"rows_per_worker": rows, "actor.ppo_micro_batch_size": micro})
        return (f"; rollout.stream_groups overlapped only {overlap:.3g} s: actor.ppo_micro_batch_size={micro} "
                f"spans more than a worker's {rows} rows, so each log-prob pass waits for several parts; "
                f"a micro-batch of {rows} or fewer rows lets a part's passes run as it arrives{update}")
    return f"; rollout.stream_groups overlapped {overlap:.3g} s of the trainer's work with the workers'{update}"


def rollout_idle(view: StepView) -> list[Finding]:
    if ROLLOUT_IDLE not in view.metrics or STEP not in view.metrics:
        return [finding("rollout_idle", OK, "no standalone rollout workers: nothing waits for requests")]
    threshold = RULES["rollout_idle"].thresholds["share"]
    share = _share(view, ROLLOUT_IDLE)
    trainer_share = _share(view, TRAINER_IDLE) if TRAINER_IDLE in view.metrics else 0.0
    staleness, workers = _knobs(view)
    status = threshold.status(share)
    evidence = {"rollout_idle_s": round(view.metrics[ROLLOUT_IDLE], 4), "step_s": round(view.metrics[STEP], 4),
                "share": round(share, 3), "trainer_idle_share": round(trainer_share, 3),
                "rollout.staleness": staleness, "rollout.workers": workers}
    if staleness == 0:
        fix = ("at rollout.staleness=0 the workers wait for every update and weight push: rollout.staleness=1 or "
               "more keeps them generating")
    elif workers > 1:
        fix = (f"generation outpaces the update: fewer rollout workers (rollout.workers, now {workers}; their "
               f"devices to the trainer), or a larger rollout.staleness (now {staleness}) to queue more steps")
    else:
        fix = (f"generation outpaces the update: a larger rollout.staleness (now {staleness}) queues more steps; "
               "or give the worker's device to the trainer (rollout.placement=colocated)")
    return [finding("rollout_idle", status, f"the rollout workers waited {view.metrics[ROLLOUT_IDLE]:.3g} s on "
                    f"average for requests or weights, {share:.0%} of the step", evidence, fix)]


def generation_tail(view: StepView) -> list[Finding]:
    m = view.metrics
    needed = ("response_length/mean", "response_length/max", "timing_s/gen", STEP)
    if not all(k in m for k in needed) or m["response_length/max"] <= 0:
        return [finding("generation_tail", OK, "no generation this step to judge")]
    rule = RULES["generation_tail"]
    ratio = m["response_length/mean"] / m["response_length/max"]
    gen_share = _share(view, "timing_s/gen")
    costly = rule.thresholds["gen_share"].status(gen_share) != OK
    status = rule.thresholds["mean_over_max"].status(ratio) if costly else OK
    staleness, _ = _knobs(view)
    clipped = m.get("response_length/clip_ratio", 0.0)
    evidence = {"response_length/mean": round(m["response_length/mean"], 2),
                "response_length/max": m["response_length/max"], "mean_over_max": round(ratio, 3),
                "gen_share": round(gen_share, 3), "clip_ratio": round(clipped, 3), "rollout.staleness": staleness}
    fix = (f"the continuous-batching engine refills finished rows from the queue (rollout.max_num_seqs); "
           f"rollout.staleness >= 1 (now {staleness}) lets the tail overlap the update; a lower "
           f"rollout.max_new_tokens cuts the tail ({clipped:.0%} of responses reach it now)")
    return [finding("generation_tail", status, f"responses average {ratio:.0%} of the longest "
                    f"({m['response_length/mean']:.3g} of {m['response_length/max']:.3g} tokens) and generation "
                    f"is {gen_share:.0%} of the step", evidence, fix)]


TOOL_TIME = "agent/tool_s/"


def tool_latency(view: StepView) -> list[Finding]:
    m = view.metrics
    if "agent/env_time_share" not in m:
        return [finding("tool_latency", OK, "single-turn rollouts: no environment to wait for")]
    share = m["agent/env_time_share"]
    tools = {k[len(TOOL_TIME):]: v for k, v in m.items() if k.startswith(TOOL_TIME)}
    slowest = max(tools, key=tools.get) if tools else None
    status = RULES["tool_latency"].thresholds["share"].status(share)
    evidence = {"env_time_share": round(share, 3), "tool_s_per_call": {k: round(v, 4) for k, v in tools.items()},
                "slowest_tool": slowest, "tool_timeouts": m.get("agent/tool_timeouts", 0.0)}
    named = f"; the slowest tool is {slowest} ({tools[slowest]:.3g} s per call)" if slowest else ""
    fix = (f"make the slow tool faster or bound it ({slowest or 'the tool'}: cache, batch its requests, a shorter "
           "timeout; an answer that times out is an error message to the model, not a hang); keep more episodes in "
           "flight so the engine decodes while tools wait (rollout.max_num_seqs); rollout.staleness >= 1 overlaps "
           "the slow episodes with the update")
    return [finding("tool_latency", status, f"episodes spent {share:.0%} of the step in their environments{named}",
                    evidence, fix if status != OK else "")]


def prefix_breaks(view: StepView) -> list[Finding]:
    m = view.metrics
    if "agent/prefix_breaks" not in m:
        return [finding("prefix_breaks", OK, "single-turn rollouts: one prompt, nothing to extend")]
    breaks = m["agent/prefix_breaks"]
    status = RULES["prefix_breaks"].thresholds["breaks"].status(breaks)
    evidence = {"agent/prefix_breaks": breaks, "agent/turns/mean": m.get("agent/turns/mean")}
    fix = ("the model's chat template rewrites earlier turns once later messages follow (e.g. Qwen3's strips "
           "<think> blocks from history): serve and train with a template that renders history as it was "
           "generated (data.chat_template with a tokenizer whose template keeps it), or accept the mismatch knowingly")
    return [finding("prefix_breaks", status, f"{breaks:g} turn(s) this step could not extend the previous prompt "
                    "token for token", evidence, fix if status != OK else "")]


SLOWEST_STEP, STEP_LIMIT, STALL_RECORD = "weight_sync/slowest_step_s", "weight_sync/timeout_s", "weight_sync_stall"


def weight_sync_stall(view: StepView) -> list[Finding]:
    record = view.context.get(STALL_RECORD)
    if record:
        return [stall_finding(record)]
    m = view.metrics
    if m.get(STEP_LIMIT, 0.0) <= 0:
        return [finding("weight_sync_stall", OK, "no weight push to standalone workers this step: nothing to watch")]
    slowest, limit = m.get(SLOWEST_STEP, 0.0), m[STEP_LIMIT]
    share = slowest / limit
    status = RULES["weight_sync_stall"].thresholds["share_of_limit"].status(share)
    evidence = {"slowest_step_s": round(slowest, 4), "weight_sync.timeout_s": limit, "share_of_limit": round(share, 3),
                "bucket_bytes_peak": m.get("weight_sync/peak_bucket_bytes")}
    fix = (f"the push's slowest step took {slowest:.3g} s of its {limit:g} s limit: raise weight_sync.timeout_s to a "
           "few times the slowest step, or shorten the step: a smaller weight_sync.bucket_mb (less to send and "
           "apply per step), a faster link between the trainer and the workers (scalerl doctor --distributed-check "
           "measures it)")
    return [finding("weight_sync_stall", status, f"the slowest step of the weight push took {slowest:.3g} s, "
                    f"{share:.0%} of weight_sync.timeout_s={limit:g} s", evidence, fix)]


def stall_finding(record: dict[str, Any]) -> Finding:
    """A push step that overran its limit, from the watchdog's failure record: who is stuck, and what to do."""
    stuck = record.get("stuck", [])
    trainer = record.get("trainer_rank", 0)
    workers = [s["rank"] for s in stuck if s["rank"] != trainer]
    named = ", ".join(f"rank {r}" for r in workers)
    resume = "; then resume the run from its last checkpoint (trainer.resume=auto)"
    if not record.get("peers_read", True):
        fix = ("rank 0, which hosts the job's store, did not answer: it is frozen or gone (its log, `py-spy dump "
               "--pid` on its host, the host's memory)")
    elif record.get("kind") == "HELLO" and workers:
        fix = (f"worker {named} did not join the push within {record['limit_key']}={record['limit_s']:g} s: it "
               "answers the generation requests queued before the push first, so a generation longer than the limit "
               "(rollout.staleness queues that many steps; long responses) needs a larger trainer.dist_timeout_s; "
               "otherwise it is stuck or gone: its log, whether its process is alive")
    elif workers:
        fix = (f"worker {named} stopped receiving at bucket {record.get('bucket')}: look at its log (a warning "
               "'the weight push ... failed', an exception or an out-of-memory in its engine's load_weights) and "
               "whether its process is alive and not frozen (`py-spy dump --pid`); if it is only slow (a large "
               "layer reloaded by vLLM, a slow link), raise weight_sync.timeout_s or lower weight_sync.bucket_mb")
    elif any(s["rank"] == trainer for s in stuck):
        fix = (f"the trainer (rank {trainer}) stopped sending: a trainer rank stuck in the gather of a sharded "
               "parameter (FSDP / tensor parallel: every trainer rank joins it) or a slow conversion of a large "
               "tensor; look at the trainer ranks' logs; raise weight_sync.timeout_s if preparing one bucket is "
               "only slow (a smaller weight_sync.bucket_mb shortens it)")
    else:
        fix = ("every side had done its part: the link did not carry the step within the limit; lower "
               "weight_sync.bucket_mb or raise weight_sync.timeout_s, and measure the link (scalerl doctor "
               "--distributed-check)")
    evidence = {k: record.get(k) for k in ("side", "rank", "sync", "kind", "bucket", "buckets", "bytes", "limit_s",
                                           "limit_key", "waiting_for", "error")}
    evidence["tensors"] = record.get("tensors", [])[:16]
    evidence["stuck"] = stuck
    ranks = tuple(s["rank"] for s in stuck) or (record.get("rank", 0),)
    return Finding(RULES["weight_sync_stall"].leaf, "weight_sync_stall", FAULT, stall_message(record), evidence,
                   fix + resume, ranks=tuple(sorted(set(ranks))))


def stall_failure_text(record: dict[str, Any]) -> str:
    """What a run stopped by the watchdog says: the leaf's finding and its fix."""
    f = stall_finding(record)
    return f"{f.summary}. Fix: {f.fix}"


def rollout_pipeline(view: StepView) -> list[Finding]:
    return (trainer_idle(view) + rollout_idle(view) + generation_tail(view) + tool_latency(view) + prefix_breaks(view)
            + weight_sync_stall(view))
