"""Interface classification from a fake sysfs tree; then the real machine, where `lo` must be loopback."""

import pytest

from scalerl.comm.net.topology import (
    RankTopology,
    detect_topology,
    parse_nvlink_status,
    parse_rate_mbit,
    read_interfaces,
    read_rdma_ports,
)
from tests.comm.fake_sysfs import add_netdev, add_rdma_device

IB_BUS, ROCE_BUS, ETH_BUS = "pci0000:00/0000:3b:00.0", "pci0000:00/0000:5e:00.0", "pci0000:00/0000:03.0"
ADDRESSES = {"ib0": ["10.10.0.5/16"], "ens5": ["192.168.1.20/24"], "eno1": ["169.254.3.4/16"],
             "docker0": ["172.17.0.1/16"], "lo": ["127.0.0.1/8"]}


@pytest.fixture
def node_sysfs(tmp_path):
    """A GPU node: IPoIB ib0, RoCE ens5, a link-local eno1 with no speed, docker0, veths (one renamed), a
    renamed bridge, a tun device, a generic virtual device, a bond with a VLAN on it, and loopback."""
    add_netdev(tmp_path, "ib0", arp_type=32, speed=-1, bus=IB_BUS)
    add_rdma_device(tmp_path, "mlx5_0", IB_BUS, rate="200 Gb/sec (4X HDR)")
    add_netdev(tmp_path, "ens5", speed=25000, bus=ROCE_BUS)
    add_rdma_device(tmp_path, "mlx5_1", ROCE_BUS, rate="25 Gb/sec (1X EDR)", link_layer="Ethernet")
    add_netdev(tmp_path, "eno1", speed=-1, bus=ETH_BUS)
    add_netdev(tmp_path, "docker0", speed=-1, bus=None, bridge=True)
    add_netdev(tmp_path, "veth12ab", speed=10000, bus=None)
    add_netdev(tmp_path, "lan", bus=None, bridge=True)  # a bridge whose name gives nothing away
    add_netdev(tmp_path, "vpn0", bus=None, tun=True)
    add_netdev(tmp_path, "dummy0", bus=None)
    add_netdev(tmp_path, "peer7", bus=None, ifindex=7, iflink=8)  # a renamed veth: it has a peer
    add_netdev(tmp_path, "node0", bus=None, ifindex=2, iflink=2)  # a veth whose peer, elsewhere, is also #2
    add_netdev(tmp_path, "bond0", speed=50000, bus=None, bonding=True, devtype="bond")
    add_netdev(tmp_path, "bond0.42", speed=50000, bus=None, devtype="vlan", ifindex=9, iflink=8)
    add_netdev(tmp_path, "lo", arp_type=772, speed="", flags="0x9", bus=None, operstate="unknown")
    return tmp_path


def test_classifies_every_kind_of_interface(node_sysfs):
    ports = read_rdma_ports(node_sysfs)
    assert [(p.device, p.link_layer, p.rate_mbit, p.netdevs) for p in ports] == [
        ("mlx5_0", "InfiniBand", 200000, ("ib0",)), ("mlx5_1", "Ethernet", 25000, ("ens5",))]
    by_name = {i.name: i for i in read_interfaces(node_sysfs, ADDRESSES, ports, drivers={"node0": "veth"})}
    kinds = {name: (i.kind, i.virtual_kind, i.speed_mbit) for name, i in by_name.items()}
    assert kinds == {
        "ib0": ("infiniband", "", 200000),  # speed from the HCA port's rate, sysfs speed is -1
        "ens5": ("roce", "", 25000),
        "eno1": ("ethernet", "", None),  # -1 => unknown
        "docker0": ("virtual", "bridge", None),
        "veth12ab": ("virtual", "veth", 10000),
        "lan": ("virtual", "bridge", 10000),
        "vpn0": ("virtual", "tun/tap", 10000),
        "dummy0": ("virtual", "virtual device", 10000),
        "peer7": ("virtual", "veth", 10000),
        "node0": ("virtual", "veth", 10000),  # told by its driver
        "bond0": ("ethernet", "", 50000),  # software device on real NICs: a link
        "bond0.42": ("ethernet", "", 50000),
        "lo": ("loopback", "", None),
    }
    assert by_name["eno1"].link_local and not by_name["ens5"].link_local
    assert by_name["ib0"].ipv4 == ("10.10.0.5/16",) and by_name["dummy0"].ipv4 == ()
    assert [n for n, i in by_name.items() if i.is_physical_link] == ["bond0", "bond0.42", "eno1", "ens5", "ib0"]


def test_detect_topology_reads_rank_env_and_round_trips_json(node_sysfs):
    topo = detect_topology(node_sysfs, env={"RANK": "5", "LOCAL_RANK": "1"}, addresses=ADDRESSES, drivers={},
                           detect_gpus=False)
    assert (topo.rank, topo.local_rank, topo.nvlink) == (5, 1, "not present")
    assert len(topo.interfaces) == 13 and len(topo.rdma_ports) == 2
    assert RankTopology.from_json(topo.to_json()) == topo


def test_missing_sysfs_and_unreadable_speed(tmp_path):
    assert read_interfaces(tmp_path / "nothing", {}) == ()
    add_netdev(tmp_path, "eth0", speed="garbage")
    (iface,) = read_interfaces(tmp_path, {})
    assert (iface.kind, iface.speed_mbit) == ("ethernet", None)


def test_rate_and_nvlink_parsing():
    assert parse_rate_mbit("100 Gb/sec (4X EDR)") == 100000
    assert parse_rate_mbit("2.5 Gb/sec (1X SDR)") == 2500
    assert parse_rate_mbit("nonsense") is None
    text = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\n"
            "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n")
    assert parse_nvlink_status(text) == ("3 active links on 2 GPUs (26.562 GB/s per link)", 3)
    assert parse_nvlink_status("GPU 0: NVIDIA A10 (UUID: GPU-1)\n") == ("not present", 0)


def test_real_machine_lo_is_loopback():
    topo = detect_topology()
    lo = topo.interface("lo")
    assert lo is not None and lo.kind == "loopback" and not lo.is_physical_link
    assert "127.0.0.1/8" in lo.ipv4
    assert topo.hostname


def test_ioctls_on_the_real_machine():
    from scalerl.comm.net.topology import _ioctl_ipv4, read_driver

    assert _ioctl_ipv4("lo") == ["127.0.0.1/8"]  # the fallback when iproute2 is missing
    assert _ioctl_ipv4("no-such-if") == []
    assert read_driver("lo") == "" and read_driver("no-such-if") == ""
