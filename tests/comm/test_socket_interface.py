"""Interface choice for gloo / NCCL sockets: a virtual or link-local default route is avoided; a set
*_SOCKET_IFNAME is checked on this node and on every node."""

import pytest

from scalerl.comm.net.cluster_topology import ClusterTopology
from scalerl.comm.net.socket_interface import (
    SocketInterfaceError,
    apply_socket_interface,
    check_interface_on_all_nodes,
    choose_socket_interface,
    read_routes,
    route_to,
)
from scalerl.comm.net.topology import NetworkInterface, RankTopology
from tests.comm.fake_sysfs import write_routes

DOCKER = NetworkInterface("docker0", "virtual", None, ("172.17.0.1/16",), virtual_kind="bridge")
ETH = NetworkInterface("ens5", "ethernet", 25000, ("10.1.2.3/24",))
IB = NetworkInterface("ib0", "infiniband", 200000, ("10.9.0.3/16",))
LINK_LOCAL = NetworkInterface("eno1", "ethernet", 1000, ("169.254.7.7/16",))
LO = NetworkInterface("lo", "loopback", None, ("127.0.0.1/8",))


def node(*interfaces, host="gpu1", rank=0):
    return RankTopology(hostname=host, rank=rank, local_rank=0, interfaces=tuple(interfaces))


def test_route_table_parsing(tmp_path):
    write_routes(tmp_path, [("docker0", "0.0.0.0", "172.17.0.254", "0.0.0.0"),
                            ("ens5", "10.1.2.0", "0.0.0.0", "255.255.255.0"),
                            ("ib0", "10.64.0.0", "10.9.0.1", "255.192.0.0")])
    routes = read_routes(tmp_path)
    assert [(r.iface, str(r.network), r.gateway, r.is_default) for r in routes] == [
        ("docker0", "0.0.0.0/0", "172.17.0.254", True), ("ens5", "10.1.2.0/24", "0.0.0.0", False),
        ("ib0", "10.64.0.0/10", "10.9.0.1", False)]
    assert route_to("10.70.1.1", routes).iface == "ib0"
    assert route_to("8.8.8.8", routes).is_default
    assert read_routes(tmp_path / "absent") == []


def test_real_default_route_is_left_alone(tmp_path):
    write_routes(tmp_path, [("ens5", "0.0.0.0", "10.1.2.254", "0.0.0.0")])
    choice = choose_socket_interface("10.1.2.9", node(ETH, DOCKER, LO), {}, procfs_root=tmp_path)
    assert choice.name is None and "ens5" in choice.reason


def test_virtual_default_route_picks_interface_on_masters_subnet(tmp_path):
    write_routes(tmp_path, [("docker0", "0.0.0.0", "172.17.0.254", "0.0.0.0")])
    choice = choose_socket_interface("10.1.2.9", node(DOCKER, IB, ETH, LO), {}, procfs_root=tmp_path)
    assert choice.name == "ens5"
    assert "docker0 is bridge" in choice.reason and "subnet" in choice.reason


def test_link_local_default_route_picks_the_route_to_master(tmp_path):
    write_routes(tmp_path, [("eno1", "0.0.0.0", "169.254.0.1", "0.0.0.0"),
                            ("ib0", "10.64.0.0", "10.9.0.1", "255.192.0.0")])
    choice = choose_socket_interface("10.70.0.1", node(LINK_LOCAL, ETH, IB, LO), {}, procfs_root=tmp_path)
    assert choice.name == "ib0" and "link-local" in choice.reason and "route" in choice.reason


def test_no_way_to_master_is_said_not_guessed(tmp_path):
    write_routes(tmp_path, [("docker0", "0.0.0.0", "172.17.0.254", "0.0.0.0")])
    choice = choose_socket_interface("10.200.0.1", node(DOCKER, ETH, IB, LO), {}, procfs_root=tmp_path)
    assert choice.name is None and "set GLOO_SOCKET_IFNAME" in choice.reason
    only = choose_socket_interface("10.200.0.1", node(DOCKER, ETH, LO), {}, procfs_root=tmp_path)
    assert only.name == "ens5" and "only real interface" in only.reason
    loop = choose_socket_interface("127.0.0.1", node(DOCKER, ETH, LO), {}, procfs_root=tmp_path)
    assert loop.name == "lo"


def test_set_variable_is_checked_on_this_node(tmp_path):
    topo = node(ETH, IB, LO)
    ok = choose_socket_interface("10.1.2.9", topo, {"GLOO_SOCKET_IFNAME": "ib0"}, procfs_root=tmp_path)
    assert (ok.name, ok.variable) == ("ib0", "GLOO_SOCKET_IFNAME")
    with pytest.raises(SocketInterfaceError, match=r"GLOO_SOCKET_IFNAME=eth0: interface eth0 does not exist on "
                                                   r"node gpu1 \(rank 0\); its interfaces are ens5, ib0, lo"):
        choose_socket_interface("10.1.2.9", topo, {"GLOO_SOCKET_IFNAME": "eth0"}, procfs_root=tmp_path)
    # NCCL's syntax: prefixes by default, "=" exact, "^" excludes.
    assert choose_socket_interface("x", topo, {"NCCL_SOCKET_IFNAME": "ib"}, procfs_root=tmp_path).name == "ib"
    assert choose_socket_interface("x", topo, {"NCCL_SOCKET_IFNAME": "^docker"}, procfs_root=tmp_path).name
    with pytest.raises(SocketInterfaceError, match="NCCL_SOCKET_IFNAME==ib: interface ib does not exist"):
        choose_socket_interface("x", topo, {"NCCL_SOCKET_IFNAME": "=ib"}, procfs_root=tmp_path)


def test_interface_missing_on_another_node():
    cluster = ClusterTopology.from_records([node(ETH, IB, LO, host="gpu1", rank=0),
                                            node(ETH, LO, host="gpu2", rank=1),
                                            node(ETH, IB, LO, host="gpu3", rank=2)])
    assert check_interface_on_all_nodes("ib0", cluster) == ["gpu2"]
    assert check_interface_on_all_nodes("ens5", cluster) == []


def test_apply_sets_both_variables_only_when_it_picks_one(tmp_path):
    # What init_distributed does before the process group starts.
    write_routes(tmp_path, [("docker0", "0.0.0.0", "172.17.0.254", "0.0.0.0")])
    env = {}
    choice = apply_socket_interface("10.1.2.9", node(DOCKER, ETH, LO), env, procfs_root=tmp_path)
    assert env == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens5"} and "docker0" in choice.reason
    write_routes(tmp_path, [("ens5", "0.0.0.0", "10.1.2.254", "0.0.0.0")])
    env = {}
    assert apply_socket_interface("10.1.2.9", node(ETH, LO), env, procfs_root=tmp_path).name is None
    assert env == {}  # a real default route: gloo / NCCL choose themselves
    env = {"GLOO_SOCKET_IFNAME": "ens5"}
    assert apply_socket_interface("10.1.2.9", node(ETH, LO), env, procfs_root=tmp_path).variable == "GLOO_SOCKET_IFNAME"
    assert env == {"GLOO_SOCKET_IFNAME": "ens5"}  # the user's choice stands, nothing added
    with pytest.raises(SocketInterfaceError, match=r"NCCL_SOCKET_IFNAME=ib0: interface ib0 does not exist on "
                                                   r"node gpu7 \(rank 3\)"):
        apply_socket_interface("10.1.2.9", node(ETH, LO, host="gpu7", rank=3), {"NCCL_SOCKET_IFNAME": "ib0"},
                               procfs_root=tmp_path)
