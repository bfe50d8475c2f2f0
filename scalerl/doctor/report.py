"""The doctor's report: findings on the tree, every rank's facts and the raw measurements, as a versioned
JSON document (`--json PATH`; schema in docs/doctor.md)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl import __version__
from scalerl.health.tree import (
    LEAVES,
    NOT_MEASURED,
    TREE,
    Finding,
    exit_code,
    roll_up,
    worst,
)

SCHEMA = "scalerl.doctor/1"
MODES = ("distributed-check", "performance-profiling")
# Why a leaf stays unmeasured when the mode that measures it did not run.
NEEDS_PROFILE = "needs training steps: scalerl doctor --performance-profiling CONFIG"
NEEDS_CHECK = "measured by scalerl doctor --distributed-check"
NEEDS_MONITOR = "watched during training by the online monitor (trainer.monitor_every)"
UNMEASURED_WHY = {
    "communication/bandwidth": NEEDS_CHECK,
    "compute/data_sharding": NEEDS_PROFILE,
    "compute/parallel_granularity": NEEDS_PROFILE,
    "training/non_finite": NEEDS_PROFILE,
    "training/reward_collapse": NEEDS_MONITOR,
    "training/logprob_mismatch": NEEDS_MONITOR,
    "resources/host_ram": NEEDS_PROFILE,
    "resources/checkpoint_cost": NEEDS_PROFILE,
    "resources/phase_switch_memory": NEEDS_PROFILE,
}


@dataclass
class DoctorReport:
    modes: list[str]
    findings: list[Finding]
    facts: list[dict[str, Any]] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    world: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"))

    def __post_init__(self):
        covered = {f.leaf for f in self.findings}
        for leaf_id in LEAVES:
            if leaf_id not in covered:
                why = UNMEASURED_WHY.get(leaf_id, "no check of the modes that ran measures it")
                self.findings.append(Finding(leaf_id, "coverage", NOT_MEASURED, why))

    @property
    def exit_code(self) -> int:
        return exit_code(self.findings)

    @property
    def status(self) -> str:
        return worst(f.status for f in self.findings)

    def tree(self) -> list[dict[str, Any]]:
        leaves = roll_up(self.findings)
        out = []
        for branch in TREE:
            rows = [leaves[leaf.id] for leaf in branch.leaves]
            out.append({"id": branch.id, "title": branch.title, "status": worst(r.status for r in rows),
                        "leaves": [{"id": r.leaf.id, "title": r.leaf.title, "question": r.leaf.question,
                                    "status": r.status, "findings": [f.to_dict() for f in r.findings]} for r in rows]})
        return out

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "created": self.created, "scalerl_version": __version__, "modes": self.modes,
                "status": self.status, "exit_code": self.exit_code, "world": self.world, "tree": self.tree(),
                "ranks": self.facts, "measurements": self.measurements}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DoctorReport:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document (schema {data.get('schema')!r})")
        findings = [Finding.from_dict(f) for branch in data["tree"] for leaf in branch["leaves"]
                    for f in leaf["findings"]]
        return cls(list(data["modes"]), findings, data.get("ranks", []), data.get("measurements", {}),
                   data.get("world", {}), data.get("created", ""))

    def with_findings(self, extra: list[Finding]) -> DoctorReport:
        """The report with ``extra`` findings (e.g. the Ray driver's), placeholders recomputed."""
        kept = [f for f in self.findings if f.rule != "coverage"] + list(extra)
        return DoctorReport(self.modes, kept, self.facts, self.measurements, self.world, self.created)
