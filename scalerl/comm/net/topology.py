"""What one rank sees of its machine: network interfaces (kind, speed, IPv4), RDMA ports, GPUs, NVLink.

Read from sysfs rather than from a library (psutil is not a dependency, and sysfs is what tells
InfiniBand, RoCE, a veth and a bridge apart). The sysfs root is a parameter so tests classify a fake
tree; IPv4 addresses come from `ip -j addr` when iproute2 is there, else from the SIOCGIFADDR ioctl.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import json
import os
import re
import shutil
import socket
import struct
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

# /sys/class/net/X/type values (ARPHRD_*) and the IFF_LOOPBACK flag bit.
ARPHRD_INFINIBAND = 32
ARPHRD_LOOPBACK = 772
IFF_LOOPBACK = 0x8
# Name prefixes of container/VM plumbing; the bridge and tun/tap checks below catch renamed ones.
VIRTUAL_NAME_PREFIXES = ("docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "vxlan", "tun", "tap")
SUBPROCESS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NetworkInterface:
    name: str
    kind: str  # "infiniband" | "roce" | "ethernet" | "loopback" | "virtual" | "wireless"
    speed_mbit: int | None  # None: unknown (sysfs says -1, or unreadable)
    ipv4: tuple[str, ...] = ()  # "10.0.0.2/24"
    virtual_kind: str = ""  # for kind "virtual": "bridge" | "veth" | "docker" | "tun/tap" | "virtual device"
    up: bool = True
    driver: str = ""  # from the ethtool ioctl ("mlx5_core", "veth", "virtio_net"); "" when unknown

    @property
    def link_local(self) -> bool:
        """True when every IPv4 address is 169.254.x.x (auto-configured, no DHCP): unusable across nodes."""
        return bool(self.ipv4) and all(ipaddress.ip_interface(a).ip.is_link_local for a in self.ipv4)

    @property
    def is_physical_link(self) -> bool:
        """A link that can leave the machine: not loopback, not container or VM plumbing."""
        return self.kind not in ("loopback", "virtual")


@dataclass(frozen=True)
class RdmaPort:
    device: str  # "mlx5_0"
    port: int
    link_layer: str  # "InfiniBand" | "Ethernet" (RoCE)
    rate_mbit: int | None
    state: str  # "4: ACTIVE"
    netdevs: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankTopology:
    """One rank's view of its node; JSON round-trips so ranks can gather it without pickle."""

    hostname: str
    rank: int
    local_rank: int
    interfaces: tuple[NetworkInterface, ...]
    rdma_ports: tuple[RdmaPort, ...] = ()
    gpus: tuple[str, ...] = ()
    nvlink: str = "not present"
    nvlink_active_links: int = 0

    def interface(self, name: str) -> NetworkInterface | None:
        return next((i for i in self.interfaces if i.name == name), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankTopology:
        data = json.loads(text)
        data["interfaces"] = tuple(NetworkInterface(**{**i, "ipv4": tuple(i["ipv4"])}) for i in data["interfaces"])
        data["rdma_ports"] = tuple(RdmaPort(**{**p, "netdevs": tuple(p["netdevs"])}) for p in data["rdma_ports"])
        data["gpus"] = tuple(data["gpus"])
        return cls(**data)


def detect_topology(sysfs_root: str | Path = "/sys", env: Mapping[str, str] | None = None,
                    addresses: Mapping[str, list[str]] | None = None, drivers: Mapping[str, str] | None = None,
                    detect_gpus: bool = True) -> RankTopology:
    """This rank's topology. `addresses` (name -> ["a.b.c.d/len"]) and `drivers` (name -> driver) replace
    asking the kernel, for a fake sysfs tree in tests."""
    env = os.environ if env is None else env
    if addresses is None:
        addresses = read_ipv4_addresses()
    if drivers is None:
        drivers = {name: d for _, name in socket.if_nameindex() if (d := read_driver(name))}
    rdma_ports = read_rdma_ports(sysfs_root)
    gpus, nvlink, links = detect_gpus_and_nvlink() if detect_gpus else ((), "not present", 0)
    return RankTopology(
        hostname=socket.gethostname(), rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)),
        interfaces=read_interfaces(sysfs_root, addresses, rdma_ports, drivers), rdma_ports=rdma_ports,
        gpus=gpus, nvlink=nvlink, nvlink_active_links=links)


# ---- network interfaces ------------------------------------------------------------------------------

def read_interfaces(sysfs_root: str | Path, addresses: Mapping[str, list[str]], rdma_ports: tuple[RdmaPort, ...] = (),
                    drivers: Mapping[str, str] | None = None) -> tuple[NetworkInterface, ...]:
    net = Path(sysfs_root) / "class" / "net"
    if not net.is_dir():
        return ()
    rdma_by_netdev = {netdev: port for port in rdma_ports for netdev in port.netdevs}
    drivers = drivers or {}
    return tuple(_classify(sysfs_root, net / name, addresses.get(name, []), rdma_by_netdev.get(name),
                           drivers.get(name, "")) for name in sorted(os.listdir(net)))


def _classify(sysfs_root: str | Path, path: Path, ipv4: list[str], rdma: RdmaPort | None,
              driver: str) -> NetworkInterface:
    name = path.name
    arp_type = _read_int(path / "type")
    flags = _read_int(path / "flags", base=16) or 0
    speed = _read_int(path / "speed")
    speed = speed if speed is not None and speed > 0 else None
    up = _read_text(path / "operstate") in ("up", "unknown", None)
    common = dict(name=name, ipv4=tuple(ipv4), up=up, driver=driver)
    if arp_type == ARPHRD_LOOPBACK or flags & IFF_LOOPBACK or name == "lo":
        return NetworkInterface(kind="loopback", speed_mbit=None, **common)
    virtual_kind = _virtual_kind(sysfs_root, path, driver)
    if virtual_kind:
        return NetworkInterface(kind="virtual", speed_mbit=speed, virtual_kind=virtual_kind, **common)
    if arp_type == ARPHRD_INFINIBAND:  # IPoIB: the HCA port's rate is the link's
        return NetworkInterface(kind="infiniband", speed_mbit=rdma.rate_mbit if rdma else speed, **common)
    if rdma is not None:  # an Ethernet netdev on an RDMA-capable port: RoCE
        return NetworkInterface(kind="roce", speed_mbit=speed or rdma.rate_mbit, **common)
    if (path / "wireless").exists():
        return NetworkInterface(kind="wireless", speed_mbit=speed, **common)
    return NetworkInterface(kind="ethernet", speed_mbit=speed, **common)


def _virtual_kind(sysfs_root: str | Path, path: Path, driver: str) -> str:
    name = path.name
    devtype = _uevent(path).get("DEVTYPE", "")
    # Bonds and VLANs are software devices too, but on real NICs: they are how many clusters reach
    # other nodes, so they count as links (their speed file gives the bond's sum / the parent's speed).
    if (path / "bonding").exists() or devtype in ("bond", "vlan") or driver in ("bonding", "802.1Q VLAN Support"):
        return ""
    if (path / "bridge").exists() or devtype == "bridge" or driver == "bridge":
        return "bridge"
    if (path / "tun_flags").exists() or name.startswith(("tun", "tap")) or driver == "tun":
        return "tun/tap"
    if name.startswith("docker"):
        return "docker"
    if name.startswith("veth") or driver == "veth":
        return "veth"
    if name.startswith(VIRTUAL_NAME_PREFIXES):
        return "virtual device"
    # Software devices live under /sys/devices/virtual/net; real NICs under their bus (pci, virtio...).
    if (Path(sysfs_root) / "devices" / "virtual" / "net" / name).exists() \
            or "/devices/virtual/net/" in os.path.realpath(path):
        # Without the driver's name: a veth has a peer (iflink != ifindex, unless the peer sits in another
        # namespace under the same index) and no DEVTYPE; dummy devices point at themselves.
        ifindex, iflink = _read_int(path / "ifindex"), _read_int(path / "iflink")
        if not devtype and ifindex is not None and iflink is not None and iflink != ifindex:
            return "veth"
        return "virtual device"
    return ""


def _uevent(path: Path) -> dict[str, str]:
    text = _read_text(path / "uevent") or ""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


# ---- RDMA (InfiniBand / RoCE) -------------------------------------------------------------------------

def parse_rate_mbit(text: str) -> int | None:
    """`ports/N/rate` text, e.g. "100 Gb/sec (4X EDR)" or "2.5 Gb/sec (1X SDR)", in Mbit/s."""
    match = re.match(r"\s*([\d.]+)\s*([GM])b/sec", text)
    if match is None:
        return None
    value = float(match.group(1))
    return int(value * 1000) if match.group(2) == "G" else int(value)


def read_rdma_ports(sysfs_root: str | Path) -> tuple[RdmaPort, ...]:
    ib = Path(sysfs_root) / "class" / "infiniband"
    if not ib.is_dir():
        return ()
    net = Path(sysfs_root) / "class" / "net"
    ports = []
    for device in sorted(os.listdir(ib)):
        netdevs = _netdevs_of_rdma_device(ib / device, net)
        for port in sorted(os.listdir(ib / device / "ports"), key=lambda p: int(p) if p.isdigit() else 0):
            port_dir = ib / device / "ports" / port
            rate = _read_text(port_dir / "rate")
            ports.append(RdmaPort(device=device, port=int(port) if port.isdigit() else 0,
                                  link_layer=_read_text(port_dir / "link_layer") or "InfiniBand",
                                  rate_mbit=parse_rate_mbit(rate) if rate else None,
                                  state=_read_text(port_dir / "state") or "unknown", netdevs=netdevs))
    return tuple(ports)


def _netdevs_of_rdma_device(device_dir: Path, net: Path) -> tuple[str, ...]:
    """Net interfaces on the same PCI function as the HCA (its IPoIB or RoCE netdev)."""
    pci = os.path.realpath(device_dir / "device")
    if not net.is_dir() or not os.path.exists(pci):
        return ()
    return tuple(sorted(name for name in os.listdir(net)
                        if os.path.exists(net / name / "device") and os.path.realpath(net / name / "device") == pci))


# ---- IPv4 addresses -----------------------------------------------------------------------------------

def read_ipv4_addresses() -> dict[str, list[str]]:
    """name -> ["a.b.c.d/len"]: from `ip -j addr` (all addresses), else one address per name via ioctl."""
    if shutil.which("ip"):
        try:
            out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True,
                                 timeout=SUBPROCESS_TIMEOUT_S, check=True).stdout
            return {link["ifname"]: [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                                     if a.get("family") == "inet"] for link in json.loads(out)}
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            pass  # fall through to the ioctl
    return {name: addr for _, name in socket.if_nameindex() if (addr := _ioctl_ipv4(name))}


def _ioctl_ipv4(name: str) -> list[str]:
    siocgifaddr, siocgifnetmask = 0x8915, 0x891B
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, request)[20:24])
            mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifnetmask, request)[20:24])
        except OSError:  # no IPv4 address on it
            return []
    return [str(ipaddress.ip_interface(f"{addr}/{mask}"))]


def read_driver(name: str) -> str:
    """The interface's driver from the ethtool ioctl (ETHTOOL_GDRVINFO); "" when it has none (lo)."""
    siocethtool, ethtool_gdrvinfo = 0x8946, 0x3
    drvinfo = array.array("B", struct.pack("I", ethtool_gdrvinfo) + bytes(192))  # struct ethtool_drvinfo
    ifreq = struct.pack("16sP", name.encode()[:15], drvinfo.buffer_info()[0]).ljust(40, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s.fileno(), siocethtool, ifreq)
        except OSError:
            return ""
    return bytes(drvinfo[4:36]).split(b"\0", 1)[0].decode(errors="replace")


# ---- GPUs and NVLink ----------------------------------------------------------------------------------

def detect_gpus_and_nvlink() -> tuple[tuple[str, ...], str, int]:
    import torch

    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    if not shutil.which("nvidia-smi"):
        return gpus, "not present (no nvidia-smi)", 0
    try:
        out = subprocess.run(["nvidia-smi", "nvlink", "-s"], capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return gpus, f"unknown (nvidia-smi nvlink -s took over {SUBPROCESS_TIMEOUT_S:.0f} s)", 0
    if out.returncode != 0:
        return gpus, f"unknown (nvidia-smi nvlink -s failed: {out.stderr.strip()[:200]})", 0
    return (gpus, *parse_nvlink_status(out.stdout))


def parse_nvlink_status(text: str) -> tuple[str, int]:
    """`nvidia-smi nvlink -s` output -> (summary, active links). Lines: "Link 0: 26.562 GB/s" or "<inactive>"."""
    active = re.findall(r"^\s*Link \d+:\s*([\d.]+)\s*GB/s", text, flags=re.M)
    gpus = len(re.findall(r"^GPU \d+:", text, flags=re.M))
    if not active:
        return "not present", 0
    per_link = sorted({float(x) for x in active})
    speeds = "/".join(f"{s:g}" for s in per_link)
    return f"{len(active)} active links on {gpus} GPUs ({speeds} GB/s per link)", len(active)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or the driver refuses the read (speed of a down link raises EINVAL)
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read_text(path)
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None
