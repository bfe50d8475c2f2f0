"""The doctor's troubleshooting tree and its rules, pure (no I/O, no collectives) so the trainer's online
monitor and `scalerl doctor` share them and tests feed them recorded measurements.

- `tree`: the leaves (communication / compute load / resources / training signal), `Finding`, roll-up,
  exit code, ``health/*`` metrics;
- `thresholds`: every rule's leaf, thresholds with reasons, and fix, as data (`RULES`);
- `step_rules`: rules on step metrics (a `StepView`, `view`), by branch in `compute_rules` (stragglers,
  token imbalance, granularity), `comm_rules` (communication share, achieved bandwidth), `resource_rules`
  (memory, host-device copies, data wait, checkpoint interval), `training_rules` (non-finite values,
  reward collapse);
- `cluster_rules`: rules on the distributed check's facts and measurements (communication), with
  `node_rules` (devices, memory, copies, storage) and `nodes` (which ranks share a node, node names);
- `wording`: findings built from the rules' data, numbers as text;
- `monitor`: `HealthMonitor`, the online monitor the trainers run every ``trainer.monitor_every`` steps.
"""

from scalerl.health.cluster_rules import run_cluster_rules
from scalerl.health.monitor import HealthMonitor
from scalerl.health.step_rules import StepView, run_step_rules
from scalerl.health.thresholds import (
                                      RULES,
                                      Rule,
                                      Severity,
                                      Threshold,
                                      describe_rules,
)
from scalerl.health.tree import (
                                      FAULT,
                                      LEAVES,
                                      NOT_MEASURED,
                                      OK,
                                      STATUSES,
                                      TREE,
                                      WARNING,
                                      Finding,
                                      LeafResult,
                                      exit_code,
                                      health_metrics,
                                      roll_up,
)

__all__ = ["FAULT", "LEAVES", "NOT_MEASURED", "OK", "RULES", "STATUSES", "TREE", "WARNING", "Finding", "HealthMonitor",
           "LeafResult", "Rule", "Severity", "StepView", "Threshold", "describe_rules", "exit_code", "health_metrics",
           "roll_up", "run_cluster_rules", "run_step_rules"]
