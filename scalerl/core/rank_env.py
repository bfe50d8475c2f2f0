"""Where this process sits in a distributed job, read from whichever launcher started it.

Every launcher (torchrun, Slurm's `srun`, OpenMPI's `mpirun`, MPICH / Intel MPI's `mpiexec`, Ray) ends in
the same call: `train(config)` with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set.
`detect_rank_env` reads the launcher's own variables into one `RankEnv`; `apply_rank_env` exports them
under torch's names so `init_process_group(init_method="env://")` works whatever started the process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from scalerl.core.errors import UserError

# Slurm jobs without MASTER_PORT get a port derived from the job id, so all ranks agree on it without
# talking, and two jobs sharing a node rarely collide (ids are consecutive, so neighbours differ).
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000


class RankEnvError(UserError, ValueError):
    """The launcher's variables are missing, malformed or contradict each other."""


@dataclass(frozen=True)
class RankEnv:
    """One process's place in the job, in torch.distributed's terms."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "openmpi" | "mpich" | "k8s-indexed-job"


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: `n[1-3,5]` -> n1 n2 n3 n5, `gpu-[01-02]` -> gpu-01 gpu-02, `a1,b2`.

    Pure Python rather than `scontrol show hostnames`: it works in a container without Slurm's
    binaries or a reachable controller, costs no subprocess, and is what every rank computes alike.
    Several brackets in one name (`r[1-2]-n[1-2]`) expand as a product; zero padding is kept.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item, hostlist))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise RankEnvError(f"unbalanced brackets in Slurm host list {whole!r}")
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    expanded = []
    for number in _expand_ranges(match.group(1), whole):
        expanded.extend(_expand_one(prefix + number + suffix, whole))
    return expanded


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7'] (the width of the lower bound sets the zero padding)."""
    numbers = []
    for part in ranges.split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            numbers.append(bounds[0])
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit() and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            numbers.extend(str(n).zfill(width) for n in range(int(bounds[0]), int(bounds[1]) + 1))
        else:
            raise RankEnvError(f"cannot read range {part!r} in Slurm host list {whole!r}")
    return numbers


def parse_tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed per-node task counts: `2(x3),1` -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise RankEnvError(f"cannot read Slurm tasks-per-node value {value!r} (expected e.g. '2(x3),1')")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise RankEnvError(f"{name}={value!r} is not an integer") from None


def _int_or(environ: Mapping[str, str], name: str, default: int) -> int:
    return _int(environ, name) if name in environ else default


def _port(environ: Mapping[str, str], default: int | None, launcher: str) -> int:
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
        if not 0 < port < 65536:
            raise RankEnvError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
        return port
    if default is None:
        raise RankEnvError(f"{launcher}: MASTER_PORT is not set; export it (e.g. MASTER_PORT=29500) on every rank")
    return default


def _check(rank: int, world: int, local_rank: int, local_world: int, names: tuple[str, str, str, str]) -> None:
    """Reject numbers that contradict each other, naming the launcher's own variables."""
    rank_name, world_name, local_name, local_world_name = names
    if world < 1:
        raise RankEnvError(f"{world_name}={world} must be >= 1")
    if not 0 <= rank < world:
        raise RankEnvError(f"{rank_name}={rank} must be in [0, {world_name}={world})")
    if local_world < 1 or local_world > world:
        raise RankEnvError(f"{local_world_name}={local_world} must be in [1, {world_name}={world}]")
    if not 0 <= local_rank < local_world:
        raise RankEnvError(f"{local_name}={local_rank} must be in [0, {local_world_name}={local_world})")


def _from_torchrun(environ: Mapping[str, str]) -> RankEnv:
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank = _int_or(environ, "LOCAL_RANK", 0)
    # Without LOCAL_WORLD_SIZE (RANK/WORLD_SIZE set by hand) assume every rank is on this node: the
    # common manual launch, and the choice that keeps LOCAL_RANK within bounds.
    local_world = _int_or(environ, "LOCAL_WORLD_SIZE", world)
    _check(rank, world, local_rank, local_world, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    node_rank = _int_or(environ, "GROUP_RANK", rank // local_world)
    return RankEnv(rank, world, local_rank, local_world, node_rank,
                   environ.get("MASTER_ADDR", "127.0.0.1"), _port(environ, 29500, "torchrun"), "torchrun")


def _from_slurm(environ: Mapping[str, str]) -> RankEnv:
    # Inside an srun step SLURM_STEP_NUM_TASKS / SLURM_STEP_TASKS_PER_NODE describe this step; the
    # SLURM_NTASKS / SLURM_TASKS_PER_NODE pair (the whole allocation) is the fallback.
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    if world_name not in environ:
        raise RankEnvError("Slurm: SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")
    rank, world = _int(environ, "SLURM_PROCID"), _int(environ, world_name)
    node_rank = _int_or(environ, "SLURM_NODEID", 0)
    local_rank = _int_or(environ, "SLURM_LOCALID", 0)
    local_world_name, local_world = _slurm_local_world(environ, node_rank, world)
    _check(rank, world, local_rank, local_world, ("SLURM_PROCID", world_name, "SLURM_LOCALID", local_world_name))
    master_addr = environ.get("MASTER_ADDR") or _slurm_first_host(environ)
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    default_port = SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN if job_id and job_id.isdigit() else None
    return RankEnv(rank, world, local_rank, local_world, node_rank, master_addr,
                   _port(environ, default_port, "Slurm (no SLURM_JOB_ID to derive a port from)"), "slurm")


def _slurm_local_world(environ: Mapping[str, str], node_rank: int, world: int) -> tuple[str, int]:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in environ:
            counts = parse_tasks_per_node(environ[name])
            if not 0 <= node_rank < len(counts):
                raise RankEnvError(f"SLURM_NODEID={node_rank} but {name}={environ[name]!r} lists {len(counts)} nodes")
            return name, counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in environ:
        return "SLURM_NTASKS_PER_NODE", _int(environ, "SLURM_NTASKS_PER_NODE")
    return "SLURM_NTASKS", world


def _slurm_first_host(environ: Mapping[str, str]) -> str:
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"):
        if environ.get(name):
            hosts = expand_hostlist(environ[name])
            if hosts:
                return hosts[0]
    raise RankEnvError("Slurm: neither MASTER_ADDR nor SLURM_JOB_NODELIST / SLURM_NODELIST is set, "
                       "so the rendezvous host is unknown")


def _from_mpi(environ: Mapping[str, str], launcher: str, names: tuple[str, str, str, str]) -> RankEnv:
    rank_name, world_name, local_name, local_world_name = names
    rank, world = _int(environ, rank_name), _int(environ, world_name)
    # With no local variables at all, assume one rank per node; with a local rank but no local size,
    # the whole world on one node.
    local_rank = _int_or(environ, local_name, 0)
    local_world = _int_or(environ, local_world_name, world if local_name in environ else 1)
    _check(rank, world, local_rank, local_world, names)
    if not environ.get("MASTER_ADDR"):
        # MPI launchers do not name a rendezvous host; guessing (e.g. this host) would hang the other nodes.
        raise RankEnvError(f"{launcher}: MASTER_ADDR is not set; pass the first node's address to every rank, "
                           "e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ... (OpenMPI) or "
                           "mpiexec -genv MASTER_ADDR node0 ... (MPICH / Intel MPI)")
    node_rank = rank // local_world if local_world else 0
    return RankEnv(rank, world, local_rank, local_world, node_rank, environ["MASTER_ADDR"],
                   _port(environ, None, launcher), launcher)


def _from_indexed_job(environ: Mapping[str, str]) -> RankEnv:
    # A Kubernetes Indexed Job (`scalerl launch k8s --kind indexed-job`): one rank per pod, pod i is rank i,
    # and the manifest sets WORLD_SIZE (completions) and MASTER_ADDR (pod 0 through the headless Service).
    rank, world = _int(environ, "JOB_COMPLETION_INDEX"), _int(environ, "WORLD_SIZE")
    _check(rank, world, 0, 1, ("JOB_COMPLETION_INDEX", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if not environ.get("MASTER_ADDR"):
        raise RankEnvError("Kubernetes Indexed Job: MASTER_ADDR is not set; it names pod 0 through the job's headless "
                           "Service (<job>-0.<service>), as `scalerl launch k8s --kind indexed-job` writes it")
    return RankEnv(rank, world, 0, 1, rank, environ["MASTER_ADDR"], _port(environ, 29500, "Kubernetes"),
                   "k8s-indexed-job")


OPENMPI_NAMES = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
MPICH_NAMES = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def detect_rank_env(environ: Mapping[str, str] | None = None) -> RankEnv | None:
    """Read this process's rank from its launcher's variables; None for a plain single process.

    Checked in order (the first that applies wins, so torchrun inside a Slurm job is torchrun):
    1. torchrun or explicit: `RANK` and `WORLD_SIZE` (+ `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
       `MASTER_PORT`, defaults 127.0.0.1:29500);
    2. Slurm under `srun`: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`/`SLURM_NTASKS`, `SLURM_LOCALID`,
       `SLURM_NODEID`, tasks per node from `SLURM_STEP_TASKS_PER_NODE`/`SLURM_TASKS_PER_NODE` (`2(x3)`)
       or `SLURM_NTASKS_PER_NODE`; master = `MASTER_ADDR` or the first host of the job's node list;
       port = `MASTER_PORT` or 15000 + SLURM_JOB_ID % 20000. A batch script itself (no `srun` step,
       `SLURM_STEP_ID` unset) is a single process, not rank 0 of the job;
    3. OpenMPI: `OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE`;
    4. MPICH / Intel MPI: `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`;
    5. a Kubernetes Indexed Job with one rank per pod: `JOB_COMPLETION_INDEX` (the rank and node), `WORLD_SIZE`
       (the completions), `MASTER_ADDR`, `MASTER_PORT` (default 29500), as `scalerl launch k8s` writes them.
    MPI ranks need `MASTER_ADDR` and `MASTER_PORT` set by the user (an error says so).
    Raises RankEnvError, naming the variables, when they contradict each other (e.g. rank >= world).
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and _in_slurm_step(environ):
        return _from_slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _from_mpi(environ, "openmpi", OPENMPI_NAMES)
    if "PMI_RANK" in environ and "PMI_SIZE" in environ:
        return _from_mpi(environ, "mpich", MPICH_NAMES)
    if "JOB_COMPLETION_INDEX" in environ and "WORLD_SIZE" in environ:
        return _from_indexed_job(environ)
    return None


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True inside an `srun` step; the batch script's own shell also has SLURM_PROCID=0 but no step id."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step != "batch"


# Set in every worker by the launcher that restarted the job: torchrun (--max-restarts) and `scalerl launch
# ray --max-restarts`. 0 or absent: the first attempt.
RESTART_COUNT_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SCALERL_RESTART_COUNT")


def launcher_restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted this job (0 on the first attempt)."""
    environ = os.environ if environ is None else environ
    for name in RESTART_COUNT_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise RankEnvError(f"{name}={value!r} is not a restart count")
            return int(value)
    return 0


def launcher_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """What stays the same across the restarts of one launcher job, and differs between jobs: the Ray
    launcher's ``SCALERL_JOB_ID``, torchrun's ``--rdzv-id`` (unless the default "none"), else, under
    torchrun, its agent process on this host (workers are restarted by the same agent). None elsewhere."""
    environ = os.environ if environ is None else environ
    if environ.get("SCALERL_JOB_ID"):
        return f"scalerl:{environ['SCALERL_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    if "TORCHELASTIC_RESTART_COUNT" in environ:
        import socket

        return f"torchrun-agent:{socket.gethostname()}:{os.getppid()}"
    return None


def apply_rank_env(env: RankEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Export the torch.distributed names (`env://` rendezvous) for `env` into `environ` (os.environ)."""
    environ = os.environ if environ is None else environ
    environ.update({
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    })
