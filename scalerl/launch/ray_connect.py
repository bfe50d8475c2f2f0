"""Connecting the Ray launcher to a cluster safely and within a limit.

- A local cluster (no address) is bound to 127.0.0.1: by default Ray's GCS, raylet and workers listen on
  every interface and advertise the machine's external address. Ray picks the loopback address only when
  it believes multi-node clusters are off (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when `ray` is
  imported), so that switch is set around `ray.init` and handed to the processes it starts.
- An address `HOST:PORT` is first probed with plain TCP for `connect_timeout_s`: `ray.init` itself retries an
  unreachable GCS for about ten minutes.
- Joining an existing cluster prints, at start, whether it uses token authentication (Ray's
  `RAY_AUTH_MODE=token`); without it, anyone who reaches its ports can run code on its nodes.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from scalerl.core.errors import UserError

_LOOPBACK = "127.0.0.1"
_CLUSTERS_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayConnectError(UserError, ConnectionError):
    """The Ray cluster named by --address (or RAY_ADDRESS) cannot be reached or joined."""


def connect_ray(address: str | None, dashboard_host: str = _LOOPBACK, connect_timeout_s: float = 30.0) -> bool:
    """Initialize Ray for the launcher; True if this call started it (the caller then shuts it down).
    An unreachable address fails before Ray is even imported (importing it fixes settings read once)."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")  # what `ray.init()` itself would connect to
    if address not in (None, "auto"):
        host, port = parse_address(address)
        _wait_for_gcs(host, port, address, connect_timeout_s)
    try:
        import ray
    except ImportError as e:
        raise RayConnectError(f"scalerl launch ray needs Ray: pip install 'scalerl[ray]' ({e})") from None
    if address is None:
        _start_local_ray(dashboard_host)
        return True
    try:  # an existing cluster's dashboard is already bound; passing a host there is an error
        ray.init(address=address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayConnectError(f"cannot join the Ray cluster at --address {address}: {str(e).splitlines()[0]}; "
                              "is it running (`ray status` there), and is this Ray the same version?") from None
    print(f"ray launch: {authentication_notice(address)}", flush=True)
    return True


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (also `ray://HOST:PORT`, `[::1]:PORT`) -> (host, port); anything else names the flag."""
    text = address.removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayConnectError(f"--address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379) or 'auto'")
    return host, int(port)


def _wait_for_gcs(host: str, port: int, address: str, timeout_s: float) -> None:
    """Return once HOST:PORT accepts TCP connections; RayConnectError after `timeout_s`."""
    deadline, last = time.monotonic() + timeout_s, "no attempt"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise RayConnectError(f"cannot reach the Ray cluster at --address {address} within --connect-timeout "
                          f"{timeout_s:g} s ({last}): start it there with `ray start --head --port {port}`, or "
                          "check the address")


def _start_local_ray(dashboard_host: str) -> None:
    """A fresh single-machine Ray whose every service listens on 127.0.0.1 only."""
    import ray
    import ray._private.ray_constants as ray_constants

    saved = os.environ.get(_CLUSTERS_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTERS_SWITCH] = "0"  # inherited by the GCS, raylet and workers started below
    ray_constants.ENABLE_RAY_CLUSTER = False  # read already, if `ray` was imported before now
    try:
        ray.init(dashboard_host=dashboard_host, _node_ip_address=_LOOPBACK)
    finally:
        if saved[0] is None:
            os.environ.pop(_CLUSTERS_SWITCH, None)
        else:
            os.environ[_CLUSTERS_SWITCH] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


def authentication_notice(address: str) -> str:
    """One line saying whether the joined cluster authenticates its clients."""
    mode = token_auth_mode()
    if mode == "token":
        return f"the Ray cluster at {address} uses token authentication (RAY_AUTH_MODE=token)"
    if mode is None:
        return (f"WARNING: the Ray cluster at {address} is unauthenticated: this Ray version has no token "
                "authentication, so anyone who can reach its ports can run code on its nodes; keep it on a "
                "private network or upgrade Ray")
    return (f"WARNING: the Ray cluster at {address} is unauthenticated (RAY_AUTH_MODE={mode}): anyone who can "
            "reach its ports can run code on its nodes; start every node and this driver with "
            "RAY_AUTH_MODE=token, or keep the cluster on a private network")


def token_auth_mode() -> str | None:
    """Ray's authentication mode ("token", "disabled", ...), or None when this Ray has no token auth."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:
        return None
    mode: Any = get_authentication_mode()
    return "token" if mode == AuthenticationMode.TOKEN else "disabled" if mode == AuthenticationMode.DISABLED \
        else str(mode)
