"""A fake sysfs tree with the files `scalerl.comm.net.topology` reads, shaped like a real one."""

from __future__ import annotations

import os
from pathlib import Path


def add_netdev(root: Path, name: str, *, arp_type: int = 1, speed: int | str = 10000, flags: str = "0x1003",
               bus: str | None = "pci0000:00/0000:00:03.0", bridge: bool = False, tun: bool = False,
               operstate: str = "up", ifindex: int = 2, iflink: int | None = None, devtype: str = "",
               bonding: bool = False) -> Path:
    """A net device: under devices/<bus>/net/NAME (a real NIC) or devices/virtual/net/NAME (bus=None),
    linked from class/net/NAME as the kernel does."""
    device_dir = root / "devices" / (bus if bus else "virtual") / "net" / name
    device_dir.mkdir(parents=True)
    files = {"type": arp_type, "speed": speed, "flags": flags, "operstate": operstate, "ifindex": ifindex,
             "iflink": ifindex if iflink is None else iflink,
             "uevent": f"INTERFACE={name}\nIFINDEX={ifindex}" + (f"\nDEVTYPE={devtype}" if devtype else "")}
    for file, value in files.items():
        (device_dir / file).write_text(f"{value}\n")
    if bonding:
        (device_dir / "bonding").mkdir()
    if bridge:
        (device_dir / "bridge").mkdir()
    if tun:
        (device_dir / "tun_flags").write_text("0x1002\n")
    if bus:  # class/net/X/device -> the PCI function, which RDMA devices share
        os.symlink(root / "devices" / bus, device_dir / "device")
    (root / "class" / "net").mkdir(parents=True, exist_ok=True)
    os.symlink(device_dir, root / "class" / "net" / name)
    return device_dir


def add_rdma_device(root: Path, name: str, bus: str, *, rate: str = "100 Gb/sec (4X EDR)",
                    link_layer: str = "InfiniBand", state: str = "4: ACTIVE") -> None:
    device_dir = root / "devices" / bus / "infiniband" / name
    port = device_dir / "ports" / "1"
    port.mkdir(parents=True)
    (port / "rate").write_text(rate + "\n")
    (port / "link_layer").write_text(link_layer + "\n")
    (port / "state").write_text(state + "\n")
    os.symlink(root / "devices" / bus, device_dir / "device")
    (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
    os.symlink(device_dir, root / "class" / "infiniband" / name)


def write_routes(procfs: Path, routes: list[tuple[str, str, str, str]]) -> None:
    """routes: (iface, destination, gateway, mask) dotted quads, written as the kernel's hex table."""
    def hex_le(addr: str) -> str:
        return bytes(int(x) for x in addr.split("."))[::-1].hex().upper()

    lines = ["Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"]
    for iface, dest, gateway, mask in routes:
        lines.append(f"{iface}\t{hex_le(dest)}\t{hex_le(gateway)}\t0003\t0\t0\t0\t{hex_le(mask)}\t0\t0\t0")
    (procfs / "net").mkdir(parents=True, exist_ok=True)
    (procfs / "net" / "route").write_text("\n".join(lines) + "\n")
