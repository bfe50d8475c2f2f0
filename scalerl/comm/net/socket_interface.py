"""Which network interface gloo / NCCL sockets should use, and a clear error when the chosen one is wrong.

The common failure: on a node whose default route goes through docker0, a VM bridge or a link-local
address, the collectives' bootstrap picks that interface and the job hangs at the first collective.
When GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are unset we pick the real interface that reaches the
master instead; when they are set, we check the named interface exists here (and on every node).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping

from scalerl.comm.net.cluster_topology import ClusterTopology
from scalerl.comm.net.topology import RankTopology
from scalerl.core.errors import UserError

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
RESOLVE_TIMEOUT_S = 5.0


class SocketInterfaceError(UserError, RuntimeError):
    """A *_SOCKET_IFNAME names an interface this node (or another) does not have."""


@dataclass(frozen=True)
class SocketInterfaceChoice:
    name: str | None  # None: leave it to gloo / NCCL
    reason: str  # one line for the log
    variable: str | None = None  # the variable it came from, when set by the user


@dataclass(frozen=True)
class Route:
    iface: str
    network: ipaddress.IPv4Network
    gateway: str

    @property
    def is_default(self) -> bool:
        return self.network.prefixlen == 0


def read_routes(procfs_root: str | Path = "/proc") -> list[Route]:
    """IPv4 routes from `<procfs>/net/route` (hex fields, little-endian as the kernel writes them)."""
    try:
        lines = (Path(procfs_root) / "net" / "route").read_text().splitlines()[1:]
    except OSError:
        return []
    routes = []
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        dest, gateway, mask = (_hex_ipv4(f) for f in (fields[1], fields[2], fields[7]))
        routes.append(Route(fields[0], ipaddress.IPv4Network(f"{dest}/{mask}", strict=False), gateway))
    return routes


def _hex_ipv4(field: str) -> str:
    return socket.inet_ntoa(int(field, 16).to_bytes(4, "little"))


def route_to(addr: str, routes: list[Route]) -> Route | None:
    """Longest-prefix match, as the kernel would route a packet to `addr`."""
    ip = ipaddress.IPv4Address(addr)
    matching = [r for r in routes if ip in r.network]
    return max(matching, key=lambda r: r.network.prefixlen, default=None)


def choose_socket_interface(master_addr: str, topology: RankTopology, env: Mapping[str, str],
                            procfs_root: str | Path = "/proc") -> SocketInterfaceChoice:
    """The interface for gloo / NCCL sockets on this node, with the reason; raises SocketInterfaceError
    when a set *_SOCKET_IFNAME names an interface this node lacks."""
    chosen = [(var, env[var]) for var in SOCKET_IFNAME_VARIABLES if env.get(var)]
    for var, value in chosen:
        missing = missing_interfaces(value, topology, nccl_syntax=var.startswith("NCCL"))
        if missing:
            raise SocketInterfaceError(
                f"{var}={value}: interface {', '.join(missing)} does not exist on node {topology.hostname} "
                f"(rank {topology.rank}); its interfaces are {', '.join(i.name for i in topology.interfaces)}")
    if chosen:
        var, value = chosen[0]
        return SocketInterfaceChoice(value, f"{var}={value} is set and exists on {topology.hostname}", var)

    routes = read_routes(procfs_root)
    default = next((r for r in routes if r.is_default), None)
    default_iface = topology.interface(default.iface) if default else None
    if default_iface is not None and default_iface.is_physical_link and not default_iface.link_local:
        return SocketInterfaceChoice(None, f"default route via {default_iface.name} ({default_iface.kind}) is a "
                                           "real interface; left to gloo / NCCL")
    why = (f"default route via {default_iface.name} is "
           f"{'link-local' if default_iface.link_local else default_iface.virtual_kind or default_iface.kind}"
           if default_iface else "no default route")
    master_ip = resolve_ipv4(master_addr)
    if master_ip is None:
        return SocketInterfaceChoice(None, f"{why}, but MASTER_ADDR {master_addr} did not resolve to IPv4 in "
                                           f"{RESOLVE_TIMEOUT_S:.0f} s; left to gloo / NCCL")
    if ipaddress.IPv4Address(master_ip).is_loopback:
        return SocketInterfaceChoice("lo", f"{why}; MASTER_ADDR {master_addr} is loopback (one node): lo")
    real = [i for i in topology.interfaces if i.is_physical_link and i.up and i.ipv4 and not i.link_local]
    for iface in real:
        if any(ipaddress.IPv4Address(master_ip) in ipaddress.ip_interface(a).network for a in iface.ipv4):
            return SocketInterfaceChoice(iface.name, f"{why}; {iface.name} is on MASTER_ADDR {master_ip}'s subnet")
    via = route_to(master_ip, [r for r in routes if not r.is_default])
    if via is not None and via.iface in {i.name for i in real}:
        return SocketInterfaceChoice(via.iface, f"{why}; the route to MASTER_ADDR {master_ip} goes via {via.iface}")
    if len(real) == 1:
        return SocketInterfaceChoice(real[0].name, f"{why}; {real[0].name} is the only real interface with an "
                                                   "address")
    names = ", ".join(i.name for i in real) or "none"
    return SocketInterfaceChoice(None, f"{why}, and no single real interface reaches MASTER_ADDR {master_ip} "
                                       f"(real interfaces: {names}); set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME")


def apply_socket_interface(master_addr: str, topology: RankTopology, env: MutableMapping[str, str],
                           procfs_root: str | Path = "/proc") -> SocketInterfaceChoice:
    """Before the process group starts: when no *_SOCKET_IFNAME is set and the default route is not a
    real interface, set both variables in ``env`` to the interface `choose_socket_interface` picks.
    Returns the choice (its reason is for the log); raises SocketInterfaceError for a set one that is
    missing here."""
    choice = choose_socket_interface(master_addr, topology, env, procfs_root)
    if choice.name is not None and choice.variable is None:
        for var in SOCKET_IFNAME_VARIABLES:
            env[var] = choice.name
    return choice


def missing_interfaces(value: str, topology: RankTopology, nccl_syntax: bool = False) -> list[str]:
    """Names in a *_SOCKET_IFNAME value with no matching interface here. NCCL's syntax: names are
    prefixes, "=" makes them exact, "^" excludes (an exclusion list cannot be missing)."""
    names = [i.name for i in topology.interfaces]
    exact = not nccl_syntax
    if nccl_syntax and value.startswith("^"):
        return []
    if nccl_syntax and value.startswith("="):
        value, exact = value[1:], True
    wanted = [w.strip() for w in value.split(",") if w.strip()]
    return [w for w in wanted if not any(n == w if exact else n.startswith(w) for n in names)]


def check_interface_on_all_nodes(name: str, cluster: ClusterTopology) -> list[str]:
    """The nodes (hostnames) that lack interface `name`; empty when every node has it."""
    return [host for host in cluster.nodes if cluster.node_record(host).interface(name) is None]


def resolve_ipv4(host: str) -> str | None:
    """`host` as an IPv4 literal; a name is resolved in a thread so a stuck resolver costs at most
    RESOLVE_TIMEOUT_S."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    result: list[str] = []

    def lookup():
        try:
            result.append(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
        except OSError:
            pass

    thread = threading.Thread(target=lookup, daemon=True, name=f"resolve {host}")
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)
    return result[0] if result else None

