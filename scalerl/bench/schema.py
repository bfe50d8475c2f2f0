"""`benchmark_report.json`: its schema (versioned, documented in docs/bench.md), the environment it records,
and checks that a file is one.

Top-level keys:

| key | what |
| --- | --- |
| ``schema`` | ``scalerl.bench/1`` |
| ``created``, ``command`` | when, and the command line that made it |
| ``environment`` | scalerl / python / torch / transformers versions, git commit (and whether the tree was dirty), host, CPU model, cores, memory, GPUs, load average before and after |
| ``config`` | the matrix (strategies, nodes, rates, compression, all-reduce, weight sync, steps, warm-up, model, batch) and the overrides every cell shares |
| ``links`` | alpha-beta fits of each emulated link and of loopback, with their sweep points |
| ``cells`` | one per matrix cell: its id and axes, ``status`` (ok / failed / skipped, with ``reason``), and when ok the measured figures (`scalerl.bench.summary`) |
| ``baselines`` | the plain PyTorch update and HF generate, measured in the calibration cell, with ratios |
| ``calibration`` | the cost model's compute rates and links |
| ``validation`` | per multi-rank cell: projected vs measured step and communication time, bytes, errors |
| ``doctor`` | a `scalerl doctor` JSON report given with ``--doctor`` (its tree goes into the PDF), or null |
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import scalerl

SCHEMA = "scalerl.bench/1"
REQUIRED = ("schema", "created", "environment", "config", "cells", "baselines", "calibration", "validation")
CELL_REQUIRED = ("id", "strategy", "nodes", "ranks_per_node", "world", "devices", "status")
MEASURED_REQUIRED = ("throughput", "latency_ms", "bytes_per_step", "bytes_per_s", "cpu", "memory", "work")


class ReportError(ValueError):
    """A file that is not a valid benchmark report; the message names the file and the problem."""


def _git(*args: str) -> str | None:
    root = Path(scalerl.__file__).resolve().parents[1]
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, commit, hardware, and how busy the host was."""
    import torch

    from scalerl.perf.memory import memory_capacity_gb

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "scalerl": scalerl.__version__, "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
        "platform": platform.platform(), "hostname": socket.gethostname(), "cpu_model": _cpu_model(),
        "cores": os.cpu_count(), "memory_gb": memory_capacity_gb(torch.device("cpu")), "gpus": gpus, "root": os.geteuid() == 0,
        "load_average_before": list(os.getloadavg()),
    }


def new_report(command: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "environment": environment(), "config": config, "links": {}, "cells": [],
            "baselines": {}, "calibration": {}, "validation": [], "doctor": None}


def problems(report: Any) -> list[str]:
    """What makes ``report`` not a valid benchmark report (empty when it is one)."""
    if not isinstance(report, dict):
        return ["not a JSON object"]
    if report.get("schema") != SCHEMA:
        return [f"schema is {report.get('schema')!r}, expected {SCHEMA!r}"]
    out = [f"missing key {k!r}" for k in REQUIRED if k not in report]
    for i, cell in enumerate(report.get("cells", [])):
        out += [f"cells[{i}] has no {k!r}" for k in CELL_REQUIRED if k not in cell]
        if cell.get("status") == "ok":
            out += [f"cells[{i}] ({cell.get('id')}) has no {k!r}" for k in MEASURED_REQUIRED if k not in cell]
        elif cell.get("status") in ("failed", "skipped") and not cell.get("reason"):
            out.append(f"cells[{i}] ({cell.get('id')}) is {cell['status']} without a reason")
    return out


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (make one with `scalerl bench -o {path}`)") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None
    found = problems(data)
    if found:
        raise ReportError(f"{path}: not a {SCHEMA} report: " + "; ".join(found[:5]))
    return data


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path
