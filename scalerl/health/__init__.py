"""The doctor's troubleshooting tree and its rules, pure (no I/O, no collectives) so the trainer's online
monitor and `scalerl doctor` share them and tests feed them recorded measurements.

- `tree`: the leaves (communication / compute load / resources / training signal), `Finding`, roll-up,
  exit code, ``health/*`` metrics, and `StepView`, what the step rules read;
- `thresholds`: every rule's leaf, thresholds with reasons, and fix, as data (`RULES`);
- `step_rules`: rules on step metrics: communication share, achieved bandwidth, memory, host-device
  copies, data wait, checkpoint interval, non-finite values, reward collapse, and `run_step_rules`; compute
  load (stragglers, token imbalance, granularity) in `compute_rules`; MoE routing in `expert_rules`; the
  rollout pipeline (trainer and worker idle time, the generation long tail) in `rollout_rules`; host RAM at
  load / checkpoint / export, the measured checkpoint cost and memory at the training/generation switch in
  `resource_rules`;
- `cluster_rules`: rules on the distributed check's facts and measurements (communication), with
  `node_rules` (which ranks share a node and its name; devices, memory, copies, storage) and
  `hardware_rules` (the config's precisions against each rank's CPU instruction sets and GPU compute
  capability; hardware that differs across ranks);
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
