"""The MFU gap, explained: a step's time at the device's peak (100% MFU) split into the achieved MFU and the
slices of time that did not run the step's useful FLOPs at peak, each read from the step's own timers and
counters (`timing_s/*`, `timing_s/comm/*`, `perf/*`, `response_length/*`), so that

    whole = ideal + evaluation + checkpointing + data + reward + weight sync + exposed communication
            + imbalance across ranks + pipeline bubbles + generation long tail + padding
            + compute below peak + unattributed

holds exactly, in seconds per step (the waterfall in MFU points is each term over ``whole``):

- ``whole``: the step (``timing_s/step``, less the doctor's own probes, ``timing_s/profiler_probes``) plus
  the evaluation (``timing_s/eval``) and checkpoint save (``timing_s/save``) time the run spends between
  steps, or those measured once and spread over their interval (the doctor's profile);
- ``ideal``: the step's useful FLOPs at the peak, ``perf/mfu`` x ``timing_s/step``; ideal / whole is the
  achieved MFU;
- evaluation, checkpointing, ``data``, ``reward``, weight sync (``update_weights``): their timers (a
  collective wait inside ``data`` or ``reward``, as the doctor's phase-ending barrier has, counts as
  communication instead);
- exposed communication and imbalance: the time ranks were blocked in collectives (``timing_s/comm/<kind>``,
  the weight sync's excepted, which its own slice holds). The least any rank waited in a kind
  (``/min``) is the transfer itself; what the others waited beyond it is waiting for the slowest rank (the
  token imbalance; ``perf/update_tokens/max`` over its mean says how uneven the tokens were). The doctor
  measures the same split directly (a barrier before each collective, `CollectiveWaits`);
- pipeline bubbles: the schedule's idle share ``(pp-1)/(m v + pp-1)`` of the update's compute time (its
  time less the waits inside it);
- generation long tail: the decode slots left idle by rows that finished while others decoded,
  ``1 - response_length/mean / response_length/max``, of the generation time (less its waits). The built-in
  engine decodes every rank's batch until the longest row of any rank ends, so the slots are rows x the
  longest response; with continuous batching (``rollout.max_num_seqs``) freed slots are refilled and this
  over-states the tail;
- padding: the update's token slots that held padding (``perf/token_slots/*`` against
  ``perf/real_tokens/*``, counted per micro-batch from tensor shapes), as a share of the update's compute time
  left after the bubbles;
- compute below peak: what remains of the compute phases' time (generation, log-prob passes, advantages,
  balancing, updates) after the ideal and the slices inside them: kernels below the device's peak and the
  non-matmul work;
- unattributed: the step's time no timer covered (``timing_s/step`` less its phases). The slices above
  are "measured" to the extent this is small: `MfuWaterfall.check` asks that it stay within a few percent.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

# A step's top-level phases (disjoint timers of the RL and SFT steps; nested ones, such as the doctor's
# ``optimizer`` inside an update, are left out).
STEP_PHASES = ("data", "gen", "gen_max", "reward", "old_log_prob", "ref", "teacher", "adv", "balance",
               "old_policy_copy", "update_critic", "update_actor", "update", "update_weights")
HOST_PHASES = ("data", "reward")
SYNC_PHASE = "update_weights"
UPDATE_PHASES = ("update_actor", "update_critic", "update")
# Comm accounting's timed kinds by where they are waited for: the weight sync's inside ``update_weights``
# (its own slice), the standalone rollout's replies inside ``gen``, the gradient/parameter/expert/sequence
# collectives inside the updates; the rest (metrics, rebalance) in other compute phases.
SYNC_COMM = "weight_sync"
GEN_COMM = ("rollout",)
UPDATE_COMM = ("grad", "param", "expert", "sequence")
# comm accounting's TIMED_KINDS (a higher layer: a test keeps the two lists equal)
COMM_KINDS = ("grad", "param", "rebalance", "rollout", "metrics", "expert", "sequence", "weight_sync")

SLICES = (
    ("eval", "evaluation"),
    ("checkpoint", "checkpointing"),
    ("data", "host wait: data"),
    ("reward", "host wait: reward"),
    ("weight_sync", "weight sync"),
    ("comm", "exposed communication"),
    ("imbalance", "imbalance across ranks (waiting for the slowest)"),
    ("bubble", "pipeline bubbles"),
    ("long_tail", "generation long tail (rows done, others decoding)"),
    ("padding", "padding"),
    ("compute", "compute below peak (kernels, non-matmul work)"),
    ("unattributed", "unattributed (no timer)"),
)
LABELS = dict(SLICES)
TOLERANCE = 0.05  # the share of the whole the slices may leave unattributed


@dataclass(frozen=True)
class CollectiveWaitSplit:
    """Seconds per step a rank spends blocked in collectives (mean over ranks), the weight sync's excepted:
    in the collective itself (``transfer_s``) and waiting for the slowest rank (``peers_s``); of their sum, the
    part inside the update phases (``update_s``), inside generation (``gen_s``) and inside each host phase
    (``host_s``, by phase: taken out of that phase's slice, so it counts once, as communication)."""

    transfer_s: float = 0.0
    peers_s: float = 0.0
    update_s: float = 0.0
    gen_s: float = 0.0
    host_s: dict[str, float] = field(default_factory=dict)


def waits_from_metrics(metrics: dict[str, float]) -> CollectiveWaitSplit:
    """The split from comm accounting's ``timing_s/comm/<kind>`` (mean over ranks) and ``/min`` (the least any
    rank waited: the transfer; the rest of the mean is waiting for the slowest). One rank's own metrics have
    no ``/min``: all of its wait counts as transfer. Where each wait is, by the step timer's
    ``timing_s/comm_in/<phase>`` (multi-rank runs: only the waits inside the step's phases count); without
    it, by kind (``metrics``, the default kind of the trainer's own all-reduces, is then placed in no
    phase)."""
    transfer = peers = update = gen = 0.0
    for kind in COMM_KINDS:
        mean = metrics.get(f"timing_s/comm/{kind}", 0.0)
        if kind == SYNC_COMM or mean <= 0:
            continue
        least = min(mean, metrics.get(f"timing_s/comm/{kind}/min", mean))
        transfer, peers = transfer + least, peers + mean - least
        update += mean if kind in UPDATE_COMM else 0.0
        gen += mean if kind in GEN_COMM else 0.0
    placed = {k.removeprefix("timing_s/comm_in/"): v for k, v in metrics.items()
              if k.startswith("timing_s/comm_in/") and k.count("/") == 2}
    if placed:
        # Comm accounting's per-kind totals also hold waits outside the step's phases (the previous step's
        # metric reduction runs after its counters were read): only the waits inside the phases count, split
        # into transfer and waiting in the proportion the kinds' least waits give.
        inside = sum(placed.get(p, 0.0) for p in STEP_PHASES if p != SYNC_PHASE)
        share = inside / (transfer + peers) if transfer + peers > 0 else 0.0
        transfer, peers = (transfer * share, peers * share) if share else (inside, 0.0)
        return CollectiveWaitSplit(transfer, peers, sum(placed.get(p, 0.0) for p in UPDATE_PHASES),
                                   placed.get("gen", 0.0), {p: placed.get(p, 0.0) for p in HOST_PHASES})
    return CollectiveWaitSplit(transfer, peers, update, gen)


def pipeline_bubble_share(layout: dict[str, Any] | None) -> float:
    """The schedule's idle share of an update, ``(pp-1)/(m v + pp-1)`` (``v`` = 2 stages per rank with
    interleaved 1F1B); 0 without pipeline parallelism."""
    layout = layout or {}
    pp = int(layout.get("pp", 1) or 1)
    if pp <= 1:
        return 0.0
    m = int(layout.get("microbatches", 1) or 1)
    v = 2 if layout.get("pp_schedule") == "interleaved_1f1b" else 1
    return (pp - 1) / (m * v + pp - 1)


@dataclass
class MfuWaterfall:
    """Seconds per step: the whole, the ideal (the useful FLOPs at peak) and each slice of `SLICES`."""

    whole_s: float
    ideal_s: float
    seconds: dict[str, float]
    notes: list[str] = field(default_factory=list)
    steps: int = 1
    # of compute below peak, the part in generation and in the update (each phase's time less its waits, its
    # own slices and its ideal at the phase's own MFU, perf/mfu/gen and perf/mfu/update); empty without them
    compute_by_phase: dict[str, float] = field(default_factory=dict)

    @property
    def achieved_mfu(self) -> float:
        return self.ideal_s / self.whole_s if self.whole_s > 0 else 0.0

    def points(self, key: str) -> float:
        """A slice as a share of the peak (MFU points, 1.0 = the whole step at peak)."""
        return self.seconds[key] / self.whole_s if self.whole_s > 0 else 0.0

    @property
    def attributed_share(self) -> float:
        """The ideal and every measured slice over the whole (1.0 when the timers cover everything)."""
        if self.whole_s <= 0:
            return 0.0
        return (self.whole_s - self.seconds["unattributed"]) / self.whole_s

    def check(self, tolerance: float = TOLERANCE) -> list[str]:
        """What keeps the waterfall from being measured: the timers leaving more than ``tolerance`` of the whole
        unattributed, or a slice below zero (some time counted in two slices). Empty when it holds."""
        problems = []
        if abs(1.0 - self.attributed_share) > tolerance:
            problems.append(f"the measured slices and the ideal sum to {100 * self.attributed_share:.1f}% of the "
                            f"whole ({self.whole_s:.4f} s per step); more than {100 * tolerance:.0f}% is not timed")
        for key, seconds in self.seconds.items():
            if seconds < -tolerance * self.whole_s:
                problems.append(f"slice {LABELS[key]!r} is {seconds:.4f} s: time counted in two slices")
        return problems

    def rows(self) -> list[dict[str, Any]]:
        """Peak, each slice, achieved: label, MFU points, seconds per step, and the level after it."""
        level = 1.0
        out = [{"key": "peak", "label": "peak", "points": 1.0, "seconds": self.whole_s, "level": 1.0}]
        for key, label in SLICES:
            level -= self.points(key)
            out.append({"key": key, "label": label, "points": self.points(key), "seconds": self.seconds[key],
                        "level": level})
        out.append({"key": "achieved", "label": "achieved MFU", "points": self.achieved_mfu, "seconds": self.ideal_s,
                    "level": self.achieved_mfu})
        return out

    def lines(self) -> list[str]:
        """The waterfall as text, one line a slice."""
        out = [f"{'':2}{'':50} {'MFU pts':>9} {'s/step':>9}"]
        for row in self.rows():
            sign = "" if row["key"] in ("peak", "achieved") else "-"
            out.append(f"  {row['label']:50} {sign + format(100 * row['points'], '.2f'):>9} {row['seconds']:9.4f}")
        out.append(f"  slices + achieved = {100 * self.attributed_share:.1f}% of the whole before 'unattributed' "
                   f"({self.steps} step(s) averaged)")
        if self.compute_by_phase:
            out.append("  of compute below peak: " + ", ".join(
                f"{name} {seconds:.4f} s" for name, seconds in self.compute_by_phase.items()))
        return out + [f"  note: {n}" for n in self.notes]

    def to_json(self) -> dict[str, Any]:
        return {"whole_s": self.whole_s, "ideal_s": self.ideal_s, "achieved_mfu": self.achieved_mfu,
                "seconds": dict(self.seconds), "attributed_share": self.attributed_share, "notes": list(self.notes),
                "steps": self.steps, "compute_by_phase": dict(self.compute_by_phase)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MfuWaterfall:
        return cls(data["whole_s"], data["ideal_s"], dict(data["seconds"]), list(data.get("notes", [])),
                   int(data.get("steps", 1)), dict(data.get("compute_by_phase", {})))


def step_waterfall(metrics: dict[str, float], layout: dict[str, Any] | None = None,
                   waits: CollectiveWaitSplit | None = None, eval_s: float | None = None,
                   checkpoint_s: float | None = None) -> MfuWaterfall:
    """One step's waterfall from its metrics (reduced over ranks, or one rank's own). ``layout``: ``pp``,
    ``microbatches``, ``pp_schedule``; ``waits``: a measured split of the collective waits (default: from comm
    accounting's metrics); ``eval_s``/``checkpoint_s``: the evaluation and save time to charge to this step
    (default: ``timing_s/eval`` and ``timing_s/save`` of the metrics)."""
    if "timing_s/step" not in metrics:
        raise KeyError("the MFU waterfall needs the step's time, timing_s/step, in its metrics (a trainer's "
                       "local_step or advance() reports it)")
    notes = []
    if "perf/mfu" not in metrics:
        notes.append("no perf/mfu in the metrics: the achieved MFU is taken as 0")
    ideal = metrics.get("perf/mfu", 0.0) * metrics["timing_s/step"]  # the step's FLOPs at peak, in seconds
    # The doctor's memory probes (`PhaseProfiler`), timed between its phases: not the run's time.
    probes = metrics.get("timing_s/profiler_probes", 0.0)
    step = metrics["timing_s/step"] - probes
    if probes:
        notes.append(f"the profiler's own memory probes ({probes:.4f} s per step) are taken out of the step")
    phase = {p: metrics.get(f"timing_s/{p}", 0.0) for p in STEP_PHASES}
    evaluation = metrics.get("timing_s/eval", 0.0) if eval_s is None else eval_s
    checkpoint = metrics.get("timing_s/save", 0.0) if checkpoint_s is None else checkpoint_s
    waits = waits_from_metrics(metrics) if waits is None else waits

    update_compute = max(0.0, sum(phase[p] for p in UPDATE_PHASES) - waits.update_s)
    bubble = pipeline_bubble_share(layout) * update_compute
    slots = sum(v for k, v in metrics.items() if k.startswith("perf/token_slots/"))
    real = sum(v for k, v in metrics.items() if k.startswith("perf/real_tokens/"))
    padding = max(0.0, 1.0 - real / slots) * (update_compute - bubble) if slots > 0 else 0.0
    longest, mean_len = metrics.get("response_length/max", 0.0), metrics.get("response_length/mean", 0.0)
    tail_share = max(0.0, 1.0 - mean_len / longest) if longest > 0 and phase["gen"] > 0 else 0.0
    long_tail = tail_share * max(0.0, phase["gen"] - waits.gen_s)
    compute_phases = sum(v for p, v in phase.items() if p not in HOST_PHASES and p != SYNC_PHASE)
    host_waits = {p: waits.host_s.get(p, 0.0) for p in HOST_PHASES}
    compute_waits = waits.transfer_s + waits.peers_s - sum(host_waits.values())
    seconds = {
        "eval": evaluation, "checkpoint": checkpoint, "data": phase["data"] - host_waits["data"],
        "reward": phase["reward"] - host_waits["reward"], "weight_sync": phase[SYNC_PHASE],
        "comm": waits.transfer_s, "imbalance": waits.peers_s, "bubble": bubble, "long_tail": long_tail,
        "padding": padding, "compute": compute_phases - ideal - compute_waits - bubble - long_tail - padding,
        "unattributed": step - sum(phase.values()),
    }
    by_phase = {}
    if "perf/mfu/gen" in metrics and "perf/mfu/update" in metrics:
        update_s = sum(phase[p] for p in UPDATE_PHASES)
        by_phase["generation"] = phase["gen"] - waits.gen_s - long_tail - metrics["perf/mfu/gen"] * phase["gen"]
        by_phase["update"] = update_compute - bubble - padding - metrics["perf/mfu/update"] * update_s
    return MfuWaterfall(step + evaluation + checkpoint, ideal, seconds, notes, compute_by_phase=by_phase)


def mean_waterfall(waterfalls: list[MfuWaterfall]) -> MfuWaterfall:
    """Seconds per step averaged over steps (a step that evaluated or saved carries that time; the mean
    spreads it over every step, as a run does)."""
    if not waterfalls:
        raise ValueError("no steps to average into a waterfall")
    n = len(waterfalls)
    seconds = {k: sum(w.seconds[k] for w in waterfalls) / n for k in waterfalls[0].seconds}
    notes = list(dict.fromkeys(note for w in waterfalls for note in w.notes))
    by_phase = {}
    if all(w.compute_by_phase for w in waterfalls):
        by_phase = {k: sum(w.compute_by_phase[k] for w in waterfalls) / n for k in waterfalls[0].compute_by_phase}
    return MfuWaterfall(sum(w.whole_s for w in waterfalls) / n, sum(w.ideal_s for w in waterfalls) / n, seconds,
                        notes, sum(w.steps for w in waterfalls), by_phase)


def run_waterfall(steps: list[dict[str, float]], layout: dict[str, Any] | None = None) -> MfuWaterfall:
    """The mean waterfall of logged steps (their reduced metrics, as a run's ``metrics.jsonl`` or a bench
    cell's ``steps.json`` hold them); steps without ``timing_s/step`` (an evaluation-only record) add their
    ``timing_s/eval``/``timing_s/save`` to the next step."""
    waterfalls, carried = [], {"timing_s/eval": 0.0, "timing_s/save": 0.0}
    for metrics in steps:
        if "timing_s/step" not in metrics:
            for key in carried:
                carried[key] += metrics.get(key, 0.0)
            continue
        merged = {**metrics, **{k: metrics.get(k, 0.0) + v for k, v in carried.items()}}
        carried = dict.fromkeys(carried, 0.0)
        waterfalls.append(step_waterfall(merged, layout))
    out = mean_waterfall(waterfalls)
    ratio = [s["perf/update_tokens/max"] / s["perf/update_tokens"] for s in steps
             if s.get("perf/update_tokens") and "perf/update_tokens/max" in s]
    if ratio:
        out.notes.append(f"update tokens: the busiest rank held {statistics.median(ratio):.2f}x the mean "
                         "(perf/update_tokens/max over its mean, median over steps)")
    return out
