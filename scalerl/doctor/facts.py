"""What one rank knows about itself without talking to the others: host, node identity, versions,
devices (each GPU's compute capability and bf16 support, the CPU's instruction sets and which matmul
precisions and oneDNN layouts it runs), network interfaces and the one collectives will use, relevant
environment, memory, free space at the run's paths. A plain JSON-able dict, the input of
`scalerl.health.cluster_rules`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from scalerl import __version__
from scalerl.comm.net.socket_interface import (
    SOCKET_IFNAME_VARIABLES,
    choose_socket_interface,
    missing_interfaces,
    read_routes,
    resolve_ipv4,
    route_to,
)
from scalerl.comm.net.topology import (
    RankTopology,
    detect_gpus_and_nvlink,
    detect_topology,
)
from scalerl.core.cpu_capabilities import ISA_SWITCH, CpuIsaError, cpu_capabilities
from scalerl.core.rank_env import RankEnv

ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "TORCH_", "TORCHELASTIC_", "SLURM_", "RAY_", "OMPI_COMM_WORLD_", "PMI_",
                "CUDA_", "OMP_")
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NVIDIA_VISIBLE_DEVICES",
             ISA_SWITCH, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # the switches of the CPU's kernel paths
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)  # values never leave the rank
NVIDIA_SMI_TIMEOUT_S = 10.0


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that decide how ranks meet and talk (NCCL_*, GLOO_*, MASTER_*, TORCH_*, Slurm, Ray,
    MPI, CUDA, OMP); values of names that look like secrets are masked."""
    keep = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    return {k: ("<masked>" if SECRET.search(k) else v) for k, v in sorted(keep.items())}


def node_id() -> str:
    """One id per machine boot and network namespace: ranks sharing it talk without crossing a link
    (hostnames alone cannot tell the emulated cluster's namespaces, or cloned images, apart)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "net"
    return f"{boot[:8]}:{netns}"


def versions() -> dict[str, str | None]:
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    nccl = None
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": cuda, "nccl": nccl,
            "gpu_driver": gpu_driver_version() if cuda else None, "scalerl": __version__,
            "ray": _installed("ray"), "transformers": _installed("transformers"), "vllm": vllm_version()}


def vllm_version() -> str | None:
    """The vLLM build and device, e.g. ``0.32.0 (cpu build)``, without importing it; None if not installed."""
    from scalerl.rollout.engines.vllm import vllm_build

    build = vllm_build()
    return None if build is None else f"{build['version']} ({build['device']} build)"


def _installed(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def gpu_driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"unknown (nvidia-smi took over {NVIDIA_SMI_TIMEOUT_S:.0f} s)"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def gpus(local_rank: int) -> list[dict[str, Any]]:
    """Visible GPUs (name, memory, compute capability, bf16); free memory only on this rank's own device
    (querying the others would create a context, and hold memory, on each)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        major, minor = torch.cuda.get_device_capability(i)
        entry = {"index": i, "name": props.name, "memory_gb": props.total_memory / 2**30, "free_gb": None,
                 "capability": f"{major}.{minor}", "bf16": gpu_bf16(major)}
        if i == local_rank % torch.cuda.device_count():
            entry["free_gb"] = torch.cuda.mem_get_info(i)[0] / 2**30
        out.append(entry)
    return out


def gpu_bf16(major: int) -> bool:
    """Whether a GPU of compute capability ``major``.x multiplies in bf16: what
    ``torch.cuda.is_bf16_supported(including_emulation=False)`` answers for it, asked without making it the
    current device (that would create a context there). Its default, with emulation, says yes on a T4 (7.5),
    where bf16 runs without tensor cores or not at all in fused kernels."""
    return bool(torch.version.hip) or major >= 8


def cpu_facts() -> dict[str, Any]:
    """`cpu_capabilities` as a dict (model, flags, torch dispatch level, bf16/fp16 matmul instructions,
    oneDNN blocked linear per dtype, the ``SCALERL_CPU_ISA`` level); a switch naming no level is reported,
    not raised, so the doctor can say so (the trainer stops on it at start)."""
    try:
        return cpu_capabilities().as_dict()
    except CpuIsaError as e:
        return {"error": str(e)}


def host_memory() -> dict[str, float]:
    values = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                values[name] = int(rest.split()[0]) / 2**20  # kB -> GiB
    except OSError:
        return {}
    return {"total_gb": values.get("MemTotal", 0.0), "available_gb": values.get("MemAvailable", 0.0)}


def socket_facts(topology: RankTopology, environ: Mapping[str, str], master_addr: str) -> dict[str, Any]:
    """Which interface collectives will use here and what it is; a set *_SOCKET_IFNAME naming an absent
    interface is reported (with the interface scalerl would pick instead), not raised."""
    available = [i.name for i in topology.interfaces]
    unset = {k: v for k, v in environ.items() if k not in SOCKET_IFNAME_VARIABLES}
    suggestion = choose_socket_interface(master_addr, topology, unset).name
    facts: dict[str, Any] = {"available": available, "suggestion": suggestion, "variable": None, "value": None,
                             "missing": []}
    for variable in SOCKET_IFNAME_VARIABLES:
        value = environ.get(variable)
        if value:
            facts.update(variable=variable, value=value,
                         missing=missing_interfaces(value, topology, nccl_syntax=variable.startswith("NCCL")))
            break
    if facts["missing"]:
        return facts
    name = facts["value"].split(",")[0].lstrip("=^") if facts["value"] and not facts["value"].startswith("^") \
        else suggestion or _routed_interface(master_addr)
    iface = topology.interface(name) if name else None
    if iface is None and name:  # NCCL's prefix syntax: "eth" matches eth0
        iface = next((i for i in topology.interfaces if i.name.startswith(name)), None)
    if iface is not None:
        facts.update(interface=iface.name, kind=iface.kind, virtual_kind=iface.virtual_kind,
                     link_local=iface.link_local, speed_mbit=iface.speed_mbit,
                     address=iface.ipv4[0].split("/")[0] if iface.ipv4 else None)
    return facts


def _routed_interface(master_addr: str) -> str | None:
    ip = resolve_ipv4(master_addr)
    if ip is not None and ip.startswith("127."):
        return "lo"
    route = route_to(ip, read_routes()) if ip else None
    return route.iface if route else None


def path_facts(paths: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Free space at each (role, path), read at its nearest existing ancestor."""
    out = []
    for role, path in paths:
        probe = Path(path).absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            free = None
        out.append({"role": role, "path": str(path), "exists": Path(path).exists(), "free_bytes": free})
    return out


def collect_rank_facts(env: RankEnv | None, paths: list[tuple[str, str]], device: torch.device,
                       environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This rank's facts; ``env`` None is a single process."""
    environ = os.environ if environ is None else environ
    topology = detect_topology(env=environ, detect_gpus=False)
    local_rank = env.local_rank if env else 0
    nvlink = detect_gpus_and_nvlink()[1] if device.type == "cuda" else "not present"
    master = f"{env.master_addr}:{env.master_port}" if env else "single process"
    cpu = cpu_facts()
    return {
        "rank": env.rank if env else 0, "world_size": env.world_size if env else 1, "local_rank": local_rank,
        "local_world_size": env.local_world_size if env else 1, "node_rank": env.node_rank if env else 0,
        "launcher": env.launcher if env else "single", "hostname": socket.gethostname(), "node_id": node_id(),
        "pid": os.getpid(), "master": master, "device": device.type, "versions": versions(),
        "gpus": gpus(local_rank), "nvlink": nvlink, "memory": host_memory(), "cpu": cpu,
        "cpu_bf16": list(cpu.get("bf16_matmul", ())),  # = cpu["bf16_matmul"], kept for reports read before "cpu"
        "interfaces": [asdict(i) for i in topology.interfaces], "rdma_ports": [asdict(p) for p in topology.rdma_ports],
        "socket": socket_facts(topology, environ, env.master_addr if env else "127.0.0.1"),
        "env": relevant_env(environ), "paths": path_facts(paths),
    }
