"""Fixtures every test directory may use: the emulated two-node network's availability check and a
two-node Ray cluster on this machine. What tests import rather than request lives beside: the tiny run
and tiny model in `tests.tiny`, the emulated network's helpers in `tests.emulated_network`, a spawned
multi-process group in `tests.spawned_group`."""

from __future__ import annotations

import pytest

from tests.emulated_network import emulated_network_unavailable

RAY_OBJECT_STORE_BYTES = 128 * 2**20


@pytest.fixture(scope="session")
def netns_ok():
    """Skips, saying why, where the emulated network (root, iproute2, network namespaces) cannot be built;
    checked once per session by building and removing a two-node network."""
    reason = emulated_network_unavailable()
    if reason is not None:
        pytest.skip(f"emulated cluster unavailable here: {reason}")


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
