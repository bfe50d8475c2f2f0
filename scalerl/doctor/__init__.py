"""`scalerl doctor`: where on the troubleshooting tree a distributed run's problems are, measured.

The rules and the tree are pure data and code in `scalerl.health` (the trainers' online monitor uses
them too); this package measures and presents:

- `facts`: one rank's host, versions, devices, interfaces, environment, paths;
- `world`: the rendezvous that names ranks that never join, and the doctor's process group;
- `bandwidth`: all-reduce sweeps (intra- / inter-node, algbw and busbw) and node-pair links;
- `storage`: shared paths (a token across nodes) and write speed; `transfer`: host<->device copies;
- `collective_waits`, `phase_profiler`, `profiling`: `--performance-profiling`, per rank and phase;
- `diagnose`: one rank's run of all of it; `ray_doctor`: the same on Ray rank actors, plus pending
  placement groups explained; `report` (JSON, schema ``scalerl.doctor/1``), `render` (the tree), `cli`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SCHEMA", "DoctorOptions", "DoctorReport", "diagnose"]
_HOME = {"SCHEMA": "report", "DoctorReport": "report", "DoctorOptions": "diagnose", "diagnose": "diagnose"}


def __getattr__(name: str) -> Any:
    # Lazy: `scalerl --help` builds the doctor's arguments (scalerl.doctor.cli) without importing torch.
    if name in _HOME:
        return getattr(importlib.import_module(f"scalerl.doctor.{_HOME[name]}"), name)
    raise AttributeError(f"module 'scalerl.doctor' has no attribute {name!r}")
