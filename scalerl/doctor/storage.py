"""Storage seen from every node: is each run path shared (a token written on one node, looked for on the
others), and how fast does the checkpoint path take writes. Only one rank per node touches the disk; the
token file is removed afterwards. A path that does not exist yet is probed at its nearest existing parent,
which is on the same filesystem unless a mount sits in between (the report says which directory it used).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from scalerl.doctor.world import DoctorWorld
from scalerl.health.node_rules import node_names

WRITE_CHUNK = 4 * 2**20


def probe_dir(path: str) -> Path:
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def write_speed(directory: Path, size: int) -> float:
    """Bytes per second of writing ``size`` bytes to a new file in ``directory`` and fsyncing it (then removed)."""
    path = directory / f".scalerl-doctor-write-{uuid.uuid4().hex}"
    chunk = os.urandom(WRITE_CHUNK)  # incompressible, so a compressing filesystem is not flattered
    start = time.perf_counter()
    try:
        with open(path, "wb") as f:
            written = 0
            while written < size:
                f.write(chunk[: min(WRITE_CHUNK, size - written)])
                written += min(WRITE_CHUNK, size - written)
            f.flush()
            os.fsync(f.fileno())
        return size / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)


def check_paths(world: DoctorWorld, paths: list[tuple[str, str]], write_bytes: int, timeout_s: float) -> dict[str, Any]:
    """``{"paths": [...]}`` for the shared-path rule and ``{"write": {rank: {path: bytes/s}}}``; collective."""
    names = node_names(world.facts)
    leaders = {}
    for f in world.facts:
        leaders.setdefault(f["node_id"], f["rank"])
    is_leader = leaders.get(next(f["node_id"] for f in world.facts if f["rank"] == world.rank)) == world.rank
    my_host = names[next(f["node_id"] for f in world.facts if f["rank"] == world.rank)]
    writer = min(leaders.values())
    tokens: dict[str, str] = {}
    errors: dict[str, str] = {}
    if world.rank == writer:
        for role, path in paths:
            directory = probe_dir(path)
            token = directory / f".scalerl-doctor-{uuid.uuid4().hex}"
            try:
                token.write_text(token.name)
                tokens[path] = str(token)
            except OSError as e:
                errors[path] = f"cannot write a token in {directory}: {e}"
    tokens = world.broadcast_json("tokens", {"tokens": tokens, "errors": errors, "host": my_host}, timeout_s)
    seen = {path: Path(t).is_file() for path, t in tokens["tokens"].items()} if is_leader else None
    speeds = {}
    if is_leader:
        for role, path in paths:
            if role == "checkpoint":
                try:
                    speeds[path] = write_speed(probe_dir(path), write_bytes)
                except OSError as e:
                    speeds[path] = None
                    errors[path] = f"cannot write in {probe_dir(path)}: {e}"
    reports = world.all_gather_json("seen", {"host": my_host, "seen": seen, "speeds": speeds}, timeout_s)
    if world.rank == writer:
        for t in tokens["tokens"].values():
            Path(t).unlink(missing_ok=True)
    out = []
    for role, path in paths:
        entry: dict[str, Any] = {"role": role, "path": path, "probed": str(probe_dir(path)), "writer": tokens["host"]}
        if path in tokens["errors"]:
            entry["why"] = tokens["errors"][path]
        else:
            others = [r for r in reports if r["seen"] is not None and r["host"] != tokens["host"]]
            entry["shared_with"] = [r["host"] for r in others if r["seen"].get(path)]
            entry["not_shared_with"] = [r["host"] for r in others if not r["seen"].get(path)]
        out.append(entry)
    write = {r["host"]: r["speeds"] for r in reports if r["speeds"]}
    return {"paths": out, "write": write}
