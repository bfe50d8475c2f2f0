"""The troubleshooting tree every finding lands on, as data, how findings roll up into it, and what the step
rules read (`StepView`).

The first three branches are the seed's tree of distributed performance; the fourth holds what the online
monitor watches besides speed (non-finite values, reward collapse); the fifth the rollout pipeline (idle
time on either side of standalone workers, the generation long tail). A leaf's status is the worst of its
findings; a leaf no check measured says "not measured", with why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

OK, WARNING, FAULT, NOT_MEASURED = "ok", "warning", "fault", "not measured"
STATUSES = (OK, WARNING, FAULT, NOT_MEASURED)
# Worst first when rolling up: a fault anywhere in a leaf is the leaf's status; "not measured" only when
# nothing in it was measured.
_SEVERITY = {NOT_MEASURED: 0, OK: 1, WARNING: 2, FAULT: 3}
# Numeric level sent to metrics backends (`health/<leaf>`); "not measured" is not sent.
LEVELS = {OK: 0, WARNING: 1, FAULT: 2}


@dataclass(frozen=True)
class Leaf:
    id: str  # "<branch>/<name>", also the metric name under health/
    title: str
    question: str  # what the leaf asks of the run, one line


@dataclass(frozen=True)
class Branch:
    id: str
    title: str
    leaves: tuple[Leaf, ...]


TREE: tuple[Branch, ...] = (
    Branch("communication", "communication", (
        Leaf("communication/library_versions", "library version mismatch",
             "do all ranks run the same torch / CUDA / NCCL / scalerl?"),
        Leaf("communication/bandwidth", "insufficient network bandwidth",
             "do collectives reach the links' speed, and is any one link slower than the rest?"),
        Leaf("communication/topology", "topology not suited to the links",
             "do ranks find each other over the right interfaces, placed node by node?"),
    )),
    Branch("compute", "compute load", (
        Leaf("compute/data_sharding", "data sharding imbalance",
             "does every data-parallel rank update on about the same number of tokens?"),
        Leaf("compute/parallel_granularity", "model-parallel granularity",
             "is each tensor/pipeline shard big enough that compute outweighs its communication and bubbles?"),
        Leaf("compute/stragglers", "uneven work across ranks (stragglers)",
             "does any rank take far longer than the others for the same work?"),
        Leaf("compute/precision", "compute precision",
             "does the run compute in a precision every rank's device multiplies fast, and in bf16 where the "
             "device measures bf16 faster than fp32?"),
        Leaf("compute/expert_load", "MoE expert load imbalance",
             "do a MoE model's experts get about the same share of tokens, and does a capacity factor drop few?"),
    )),
    Branch("resources", "resources", (
        Leaf("resources/accelerator_memory", "accelerator memory",
             "is there headroom below the device's memory, in generation and in the update?"),
        Leaf("resources/host_device_transfer", "host-device transfer",
             "do copies between host and device run at the bus's speed and stay a small share of the step?"),
        Leaf("resources/storage_io", "storage I/O",
             "is there room and speed at the output and checkpoint paths, shared across nodes, and does "
             "data loading keep up?"),
        Leaf("resources/host_ram", "host RAM",
             "do a node's ranks fit in its RAM while the model loads, a checkpoint is saved and the model is "
             "exported?"),
        Leaf("resources/checkpoint_cost", "checkpoint cost",
             "does saving a checkpoint take a small share of the training time between saves?"),
        Leaf("resources/phase_switch_memory", "memory at the training/generation switch",
             "at each switch between training and generation, do what the last phase left and what the next "
             "one adds fit the device, with room for longer responses?"),
    )),
    Branch("training", "training signal", (
        Leaf("training/non_finite", "non-finite values", "are losses and gradient norms finite?"),
        Leaf("training/reward_collapse", "reward collapse", "does the reward still vary and hold its level?"),
        Leaf("training/logprob_mismatch", "train/inference mismatch",
             "do the trainer's log-probs of the sampled tokens stay close to the engine's, without growing?"),
    )),
    Branch("rollout", "rollout pipeline", (
        Leaf("rollout/trainer_idle", "trainer waiting for rollouts",
             "does the trainer have the next step's rollouts when it needs them?"),
        Leaf("rollout/rollout_idle", "rollout workers waiting",
             "do standalone rollout workers always have a request to generate?"),
        Leaf("rollout/generation_tail", "generation long tail",
             "do a step's responses end at similar lengths, or does the longest keep the batch decoding?"),
        Leaf("rollout/tool_latency", "tool-latency-bound agent rollouts",
             "do multi-turn episodes spend their time generating, or waiting for their tools (which one)?"),
        Leaf("rollout/prefix_breaks", "chat-template prefix breaks",
             "does every turn's prompt extend the last one token for token, as the model will see it served?"),
        Leaf("rollout/weight_sync_stall", "weight-sync watchdog",
             "does every step of a weight push to the rollout workers finish within weight_sync.timeout_s, "
             "and if one stalls, which side (the trainer sending, which worker receiving) and which bucket?"),
    )),
)
LEAVES: dict[str, Leaf] = {leaf.id: leaf for branch in TREE for leaf in branch.leaves}


@dataclass(frozen=True)
class Finding:
    """One measured statement about a leaf: its status, the evidence, and what to change."""

    leaf: str
    rule: str  # id of the rule that produced it (see `scalerl.health.rules`)
    status: str
    summary: str  # one line, with the measured numbers
    evidence: dict[str, Any] = field(default_factory=dict)  # JSON-able measured values
    fix: str = ""  # a config key, an environment variable or a command; empty for ok / not measured
    ranks: tuple[int, ...] = ()  # the ranks concerned, when it names some
    hosts: tuple[str, ...] = ()

    def __post_init__(self):
        if self.leaf not in LEAVES:
            raise ValueError(f"unknown leaf {self.leaf!r}; one of {', '.join(LEAVES)}")
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; one of {', '.join(STATUSES)}")

    @property
    def key(self) -> tuple[str, str, tuple[int, ...], tuple[str, ...]]:
        """What makes two findings 'the same problem' across checks (the monitor's crossing memory)."""
        return self.rule, self.leaf, self.ranks, self.hosts

    def to_dict(self) -> dict[str, Any]:
        return {"leaf": self.leaf, "rule": self.rule, "status": self.status, "summary": self.summary,
                "evidence": self.evidence, "fix": self.fix, "ranks": list(self.ranks), "hosts": list(self.hosts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(data["leaf"], data["rule"], data["status"], data["summary"], dict(data.get("evidence", {})),
                   data.get("fix", ""), tuple(data.get("ranks", ())), tuple(data.get("hosts", ())))


def worst(statuses: Iterable[str]) -> str:
    """The most severe status; "not measured" for none."""
    return max(statuses, key=_SEVERITY.__getitem__, default=NOT_MEASURED)


@dataclass(frozen=True)
class LeafResult:
    leaf: Leaf
    status: str
    findings: tuple[Finding, ...]


def roll_up(findings: Iterable[Finding]) -> dict[str, LeafResult]:
    """Every leaf of the tree with its findings (worst first) and its status."""
    by_leaf: dict[str, list[Finding]] = {leaf_id: [] for leaf_id in LEAVES}
    for finding in findings:
        by_leaf[finding.leaf].append(finding)
    return {leaf_id: LeafResult(LEAVES[leaf_id], worst(f.status for f in found),
                                tuple(sorted(found, key=lambda f: -_SEVERITY[f.status])))
            for leaf_id, found in by_leaf.items()}


def exit_code(findings: Iterable[Finding]) -> int:
    """1 when any finding is a fault (it would stop or cripple training), else 0."""
    return 1 if any(f.status == FAULT for f in findings) else 0


def health_metrics(findings: Iterable[Finding]) -> dict[str, float]:
    """``health/<leaf>`` = 0 (ok), 1 (warning), 2 (fault) for every measured leaf, for metrics backends."""
    return {f"health/{leaf_id}": float(LEVELS[result.status]) for leaf_id, result in roll_up(findings).items()
            if result.status in LEVELS}


PROFILE_HINT = "scalerl doctor --performance-profiling CONFIG measures it"


@dataclass
class StepView:
    """What the step rules read.

    ``metrics``: one step's metrics reduced over ranks (the trainer's names; spreads as ``<name>/max``...).
    ``per_rank``: when profiled, one dict per rank: ``rank``, ``host``, ``step_s``, ``busy_s`` (own work) and
    ``busy_by_step``, ``wait_s`` (blocked on peers and in collectives), ``comm_s`` (in collectives after peers arrived),
    ``update_tokens``, ``copy_s``, ``phases`` ({phase: {time_s, busy_s, wait_s, peak_gb}}), ``capacity_gb``.
    ``context``: facts from the config and the machine (see each rule).
    ``history``: the reduced metrics of the last steps, oldest first (the online monitor's memory), so a
    rule can ask whether something holds step after step.
    """

    metrics: dict[str, float]
    per_rank: list[dict[str, Any]] | None = None
    context: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return int(self.context.get("world_size", len(self.per_rank) if self.per_rank else 1))
