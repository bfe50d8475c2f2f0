"""Fixtures every test directory may use: the emulated two-node network's availability check and a
two-node Ray cluster on this machine. What tests import rather than request lives beside: the tiny run
and tiny model in `tests.tiny`, the emulated network's helpers in `tests.emulated_network`, a spawned
multi-process group in `tests.spawned_group`.

`cpu_isa` runs a test once on the CPU's own fast paths and once with them switched off
(``SCALERL_CPU_ISA=default``: plain layouts only), so every machine tests the fallback, whatever its CPU;
`needs_onednn_blocked` skips, naming why, a test of the fast path on a CPU that lacks it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from scalerl.core.cpu_capabilities import ISA_SWITCH, CpuCapabilities, cpu_capabilities
from tests.emulated_network import emulated_network_unavailable

RAY_OBJECT_STORE_BYTES = 128 * 2**20
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def netns_ok():
    """Skips, saying why, where the emulated network (root, iproute2, network namespaces) cannot be built;
    checked once per session by building and removing a two-node network."""
    reason = emulated_network_unavailable()
    if reason is not None:
        pytest.skip(f"emulated cluster unavailable here: {reason}")


@pytest.fixture(scope="session")
def repo_script():
    """Loads a script of this repository that is not a package module (a benchmark, a wrapper) by its path from
    the repository root, as a fresh module: ``repo_script("benchmarks/algorithms.py")``."""
    def load(relative: str):
        path = REPO / relative
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="module")
def ray_cluster():
    """A `ray.cluster_utils.Cluster` of two simulated nodes (2 logical CPUs each, a small object store) with
    this process connected as its driver; one per module, as starting Ray is the expensive part.
    GLOO_SOCKET_IFNAME keeps gloo on loopback (the launcher tests check it is passed through). Modules
    using it set RAY_AUTH_MODE / RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER before importing Ray, which reads them
    at import."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:
        env.setenv("GLOO_SOCKET_IFNAME", "lo")
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "object_store_memory": RAY_OBJECT_STORE_BYTES, "include_dashboard": False})
        try:
            nodes.add_node(num_cpus=2, object_store_memory=RAY_OBJECT_STORE_BYTES)
            nodes.wait_for_nodes()
            ray.init(address=nodes.address, log_to_driver=False)
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()


@pytest.fixture(params=["native", "default"])
def cpu_isa(request, monkeypatch) -> CpuCapabilities:
    """The test runs at ``SCALERL_CPU_ISA=native`` (the hardware's fast paths) and ``default`` (none: the
    fallback every CPU runs); returns the capabilities the code sees at that level."""
    monkeypatch.setenv(ISA_SWITCH, request.param)
    return cpu_capabilities()


def needs_onednn_blocked(dtype: torch.dtype) -> None:
    """Skip (with the probe's reason) where this CPU's oneDNN does not run the blocked ``dtype`` linear."""
    why = cpu_capabilities().onednn_linear.get({torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], "")
    if why:
        pytest.skip(f"this CPU's fast path is not there: {why}")
