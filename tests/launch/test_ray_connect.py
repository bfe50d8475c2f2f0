"""Connecting to Ray safely: an unreachable --address fails within --connect-timeout naming it; a local
cluster listens on 127.0.0.1 only; joining a cluster says whether it authenticates its clients."""

from __future__ import annotations

import ipaddress
import os
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # read when Ray is imported: no token written under ~/.ray
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from scalerl.core.net import free_port  # noqa: E402
from scalerl.launch import ray_connect  # noqa: E402
from scalerl.launch.ray_connect import RayConnectError, connect_ray, parse_address  # noqa: E402


def test_parse_address():
    assert parse_address("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert parse_address("ray://head:10001") == ("head", 10001)
    assert parse_address("[::1]:6379") == ("::1", 6379)
    for bad in ("head", "head:port", ":6379", "head:70000"):
        with pytest.raises(RayConnectError, match="HOST:PORT"):
            parse_address(bad)


def test_unreachable_address_fails_within_the_limit_naming_it():
    assert not ray.is_initialized()
    address = f"127.0.0.1:{free_port()}"  # a loopback port nobody serves
    start = time.monotonic()
    with pytest.raises(RayConnectError, match=f"cannot reach the Ray cluster at --address {address} within "
                                              "--connect-timeout 1 s"):
        connect_ray(address, connect_timeout_s=1.0)
    assert time.monotonic() - start < 5 and not ray.is_initialized()


def test_authentication_notice_warns_unless_token_auth(monkeypatch):
    monkeypatch.setattr(ray_connect, "token_auth_mode", lambda: "token")
    assert "uses token authentication" in ray_connect.authentication_notice("head:6379")
    monkeypatch.setattr(ray_connect, "token_auth_mode", lambda: "disabled")
    notice = ray_connect.authentication_notice("head:6379")
    assert notice.startswith("WARNING: the Ray cluster at head:6379 is unauthenticated")
    assert "RAY_AUTH_MODE=token" in notice
    monkeypatch.setattr(ray_connect, "token_auth_mode", lambda: None)
    assert "no token authentication" in ray_connect.authentication_notice("head:6379")


def _listening_addresses() -> dict[str, set[str]]:
    """Listening TCP addresses of this process and everything it started, by process name."""
    me = psutil.Process()
    found: dict[str, set[str]] = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            for conn in process.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.setdefault(process.name(), set()).add(conn.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_local_cluster_listens_on_loopback_only():
    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process")
    switch = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    assert connect_ray(None) is True
    try:
        listening = _listening_addresses()
        assert "gcs_server" in listening and "raylet" in listening, listening
        for name, addresses in listening.items():
            for address in addresses:
                ip = ipaddress.ip_address(address)
                ip = ip.ipv4_mapped or ip if ip.version == 6 else ip
                assert ip.is_loopback, f"{name} listens on {address}"
        assert ray.util.get_node_ip_address() == "127.0.0.1"
    finally:
        ray.shutdown()
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == switch  # the switch is put back
