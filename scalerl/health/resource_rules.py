"""Rules on what a run holds and spends outside its steady step, from `--performance-profiling`'s per-rank
records: host RAM while the model loads, a checkpoint is saved and the model is exported (summed over a
node's ranks, against the node's memory); the seconds the run's own save takes against the training time
between saves; and memory at each switch between training and generation, split into what the phase
before left and what the phase switched to added. Each is "not measured" (with why) without a profile."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from scalerl.health.thresholds import RULES
from scalerl.health.tree import NOT_MEASURED, OK, PROFILE_HINT, Finding, StepView
from scalerl.health.wording import finding

HOST_RAM_PHASES = ("load", "checkpoint", "export")
# The step phases on either side of the switch (the trainer's timer names); the rest (data, reward, advantages,
# weight push, the optimizer nested in the update) hold what they hold on both sides and are passed over.
GENERATION_PHASES = ("gen", "gen_max")
TRAINING_PHASES = ("old_log_prob", "ref", "teacher", "update_actor", "update_critic", "update")
# What the checkpoint-cost fix aims the save interval at: the warning's share of the training time.
TARGET_SAVE_SHARE = RULES["checkpoint_cost"].thresholds["share"].warning


def _sharded_layout(context: dict[str, Any]) -> bool:
    """Whether the layout shards the model over ranks (FSDP2 or TP without pipeline stages): then each rank
    loads and saves only its own slices (`loads_local_shards`, per-rank checkpoint shards)."""
    dp, replicate = context.get("dp_size", 1), context.get("dp_replicate", context.get("dp_size", 1))
    return context.get("pp", 1) == 1 and (context.get("tp", 1) > 1 or dp > replicate)


def _host_ram_fix(phase: str, ranks_on_node: int, context: dict[str, Any]) -> str:
    fewer = (f"fewer ranks on the node (it runs {ranks_on_node}; torchrun --nproc-per-node, or more nodes)"
             if ranks_on_node > 1 else "a node with more memory")
    sharded = _sharded_layout(context)
    if phase == "load":
        return (f"{fewer}; " + ("the layout already loads each rank's own slices" if sharded else
                                "a sharded layout (parallel.dp_shard=<ranks> or parallel.tp > 1, parallel.pp=1) "
                                "has each rank read only its own slices of the model directory instead of the "
                                "whole model"))
    if phase == "checkpoint":
        return (f"{fewer}; " + ("the layout already saves per-rank shards" if sharded else
                                "a sharded layout (parallel.dp_shard=<ranks>) saves each rank's shard of the "
                                "weights and optimizer state instead of whole copies") +
                "; scalerl saves synchronously (an asynchronous save would add a host copy, not remove one)")
    return (f"{fewer}; a smaller trainer.export_max_shard_size (rank 0 holds one shard file and one full tensor "
            "at a time); or export later from the checkpoint, on a machine with room: scalerl export CHECKPOINT DIR")


def host_ram(view: StepView) -> list[Finding]:
    """Per node and per phase (load, checkpoint, export): the sum of its ranks' peak resident sets against
    the node's memory; the worst node and phase named."""
    records = [r for r in view.per_rank or [] if r.get("host_ram") and r.get("node_memory_gb")]
    if not records:
        return [finding("host_ram", NOT_MEASURED, "host RAM at load, checkpoint and export is measured around "
                        f"the profiled steps; {PROFILE_HINT}")]
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_node[r.get("host", "")].append(r)
    worst: tuple[float, str, str, float, float] | None = None  # fraction, node, phase, summed peak, node memory
    table: dict[str, dict[str, float]] = {}
    for host, ranks in by_node.items():
        memory = min(r["node_memory_gb"] for r in ranks)
        table[host] = {"node_memory_gb": round(memory, 2)}
        for phase in HOST_RAM_PHASES:
            peaks = [r["host_ram"][phase] for r in ranks if phase in r["host_ram"]]
            if not peaks:
                continue
            total = sum(peaks)
            table[host][f"{phase}_gb"] = round(total, 3)
            if worst is None or total / memory > worst[0]:
                worst = (total / memory, host, phase, total, memory)
    if worst is None:
        return [finding("host_ram", NOT_MEASURED, "no load, checkpoint or export peak in the profile")]
    fraction, host, phase, total, memory = worst
    ranks = sorted(r["rank"] for r in by_node[host])
    status = RULES["host_ram"].thresholds["fraction"].status(fraction)
    reset = all(r.get("host_peak_reset", True) for r in records)
    note = "" if reset else " (the kernel refused to reset the peak: lifetime peaks, an over-estimate)"
    evidence = {"node": host, "phase": phase, "peak_gb": round(total, 3), "node_memory_gb": round(memory, 2),
                "fraction": round(fraction, 3), "source": records[0].get("node_memory_source", ""),
                "ranks_on_node": len(ranks), "per_node": table, "peak_reset": reset}
    where = f"its {len(ranks)} ranks summed" if len(ranks) > 1 else "one rank"
    return [finding("host_ram", status, f"host RAM peaks at {total:.2f} of {memory:.2f} GiB ({fraction:.0%}) on "
                    f"{host or 'the node'} at {phase} time ({where}){note}", evidence,
                    _host_ram_fix(phase, len(ranks), view.context),
                    ranks=ranks if status != OK else (), hosts=[host] if status != OK and host else ())]


def checkpoint_cost(view: StepView) -> list[Finding]:
    """The measured save's seconds as a share of the run's time: save / (time between saves + save)."""
    c = view.context
    step_s = view.metrics.get("timing_s/step", 0.0)
    if "save_s" not in c or step_s <= 0:
        return [finding("checkpoint_cost", NOT_MEASURED, "the run's own save is timed after the profiled steps; "
                        + PROFILE_HINT)]
    save_s, every = c["save_s"], int(c.get("save_every", 0))
    steps = every or int(c.get("total_steps", 0))
    if steps <= 0:
        return [finding("checkpoint_cost", NOT_MEASURED, "trainer.save_every=0 and no step count: saved once, "
                        "at the end")]
    interval = steps * step_s
    share = save_s / (interval + save_s)
    thresholds = RULES["checkpoint_cost"].thresholds
    total_steps = int(c.get("total_steps", 0)) or steps
    saves = max(1, math.ceil(total_steps / steps))  # with save_every: every save_every steps and at the last
    floor = thresholds["min_total_s"]
    status = thresholds["share"].status(share) if floor.status(saves * save_s) != OK else OK
    note = (f"; {saves} save(s) in all, {saves * save_s:.1f} s, under the {floor.warning:g} s over a run that counts"
            if thresholds["share"].status(share) != status else "")
    # share <= target  <=>  save_every x step_s >= save_s (1 - target) / target
    suggestion = math.ceil(save_s * (1 - TARGET_SAVE_SHARE) / TARGET_SAVE_SHARE / step_s)
    records = view.per_rank or []
    slowest = max(records, key=lambda r: r.get("save_s", 0.0), default={})
    state = slowest.get("state_bytes")
    rate = (f", {state / save_s / 2**20:.1f} MiB of state per second on rank {slowest['rank']}"
            if state and save_s else "")
    evidence = {"save_s": round(save_s, 3), "step_s": round(step_s, 4), "save_every": every,
                "steps_between_saves": steps, "share": round(share, 4), "saves": saves,
                "total_save_s": round(saves * save_s, 2)}
    if state:
        evidence.update(rank=slowest.get("rank"), state_mb=round(state / 2**20, 2),
                        write_mb_s=round(state / save_s / 2**20, 2) if save_s else None)
    between = f"the {every} steps between saves" if every else f"the run's {steps} steps (trainer.save_every=0: once)"
    fix = (f"trainer.save_every={suggestion} (or more) keeps saves under {TARGET_SAVE_SHARE:.0%} of the time; write "
           "checkpoints to faster local storage (trainer.output_dir); " +
           ("the layout already writes per-rank shards" if _sharded_layout(c) else
            "a sharded layout (parallel.dp_shard=<ranks>) has every rank write its own shard at once") +
           "; scalerl has no asynchronous save")
    return [finding("checkpoint_cost", status, f"a checkpoint save takes {save_s:.2f} s, {share:.0%} of the "
                    f"training time ({between} at {step_s:.3f} s each{rate}{note})", evidence, fix,
                    ranks=[slowest["rank"]] if status != OK and "rank" in slowest else ())]


def _side(phase: str) -> str | None:
    return "generation" if phase in GENERATION_PHASES else "training" if phase in TRAINING_PHASES else None


def _switch_fix(into: str, held: float, added: float, context: dict[str, Any]) -> str:
    shard = ("" if _sharded_layout(context) else
             "parallel.dp_shard=<ranks> (FSDP2 shards parameters, gradients and optimizer state); ")
    if into == "generation":
        own = ("fewer rows decoding at once (rollout.max_num_seqs), shorter responses (rollout.max_new_tokens), "
               "with vLLM a smaller KV budget (rollout.vllm_kv_cache_gib)")
        left = (f"{shard}or generate on ranks of their own (rollout.placement=standalone), so neither side holds "
                "the other's memory; scalerl does not offload training state to host memory")
    else:
        own = ("a smaller actor.ppo_micro_batch_size or actor.micro_batch_max_tokens, "
               "model.activation_checkpointing=true")
        left = (f"{shard}or generate on ranks of their own (rollout.placement=standalone); with vLLM a smaller "
                "rollout.vllm_kv_cache_gib")
    first, second = (own, left) if added >= held else (left, own)
    return f"{first}; then {second}"


def _process_fix(baseline: float) -> str:
    return (f"most of it ({baseline:.2f} GiB) the process held before the model loaded (interpreter, libraries, "
            "CUDA context): fewer ranks on the node or more memory; then ")


def phase_switch_memory(view: StepView) -> list[Finding]:
    """Each switch between training and generation in step order (the last phase of a step switches to the
    first of the next): the switched-to phase's peak against capacity, the worst named."""
    records = [r for r in view.per_rank or [] if r.get("capacity_gb") and r.get("phases")]
    worst = None  # fraction, rank record, (from, to), peak, held
    for r in records:
        order = [p for p in r["phases"] if _side(p)]
        if len({_side(p) for p in order}) < 2:
            continue
        for i, to in enumerate(order):
            before = order[i - 1]  # i = 0: the last phase of the step before
            if _side(before) == _side(to):
                continue
            stats = r["phases"][to]
            peak, held = stats.get("peak_gb", 0.0), min(stats.get("start_gb", 0.0), stats.get("peak_gb", 0.0))
            fraction = peak / r["capacity_gb"]
            if worst is None or fraction > worst[0]:
                worst = (fraction, r, (before, to), peak, held)
    if not records:
        return [finding("phase_switch_memory", NOT_MEASURED, f"per-phase peaks come from a profile; {PROFILE_HINT}")]
    if worst is None:
        return [finding("phase_switch_memory", NOT_MEASURED, "the profiled step has no switch between training and "
                        "generation (an SFT run, or generation on standalone workers)")]
    fraction, r, (before, to), peak, held = worst
    added, capacity = peak - held, r["capacity_gb"]
    # What the process held before the model was loaded (on a CPU: the interpreter and its libraries) is
    # held on both sides and no setting of the run moves it.
    baseline = min(r.get("baseline_gb", 0.0), held)
    status = RULES["phase_switch_memory"].thresholds["fraction"].status(fraction)
    into = _side(to)
    evidence = {"switch": f"{before} -> {to}", "rank": r["rank"], "peak_gb": round(peak, 3),
                "held_gb": round(held, 3), "added_gb": round(added, 3), "baseline_gb": round(baseline, 3),
                "capacity_gb": round(capacity, 3), "fraction": round(fraction, 3),
                "device": view.context.get("device", "")}
    of_which = f", {baseline:.2f} of it the process before the model loaded" if baseline >= 0.01 else ""
    return [finding("phase_switch_memory", status, f"switching {before} -> {to}, rank {r['rank']} peaks at "
                    f"{peak:.2f} of {capacity:.2f} GiB ({fraction:.0%}): {held:.2f} GiB already held when {to} "
                    f"started (after {before}{of_which}) + {added:.2f} GiB {to} added", evidence,
                    (_process_fix(baseline) if baseline >= 0.5 * peak else "") +
                    _switch_fix(into, held - baseline, added, view.context), ranks=[r["rank"]] if status != OK else ())]


RESOURCE_RULES = (host_ram, checkpoint_cost, phase_switch_memory)
