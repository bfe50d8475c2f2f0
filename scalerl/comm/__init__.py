"""Communication layer: what the network looks like and which interface collectives should use.

- `topology`: `detect_topology()` reads one rank's node (interfaces with kind and speed, IPv4, RDMA
  ports, GPUs, NVLink) into a `RankTopology`.
- `cluster_topology`: `gather_topology()` collects every rank's record (JSON in tensors, no pickle) into
  a `ClusterTopology`: nodes, ranks per node, contiguity, the slowest inter-node link, `summary()`.
- `socket_interface`: `choose_socket_interface()` picks the interface for gloo / NCCL sockets, or checks
  the one GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names; `check_interface_on_all_nodes()`.
"""

from scalerl.comm.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.socket_interface import (SocketInterfaceChoice, SocketInterfaceError, check_interface_on_all_nodes,
                                           choose_socket_interface)
from scalerl.comm.topology import NetworkInterface, RankTopology, RdmaPort, detect_topology

__all__ = ["ClusterTopology", "NetworkInterface", "RankTopology", "RdmaPort", "SocketInterfaceChoice",
           "SocketInterfaceError", "check_interface_on_all_nodes", "choose_socket_interface", "detect_topology",
           "gather_topology"]
