"""Communication layer: what the network looks like and which interface collectives should use.

- `topology`: `detect_topology()` reads one rank's node (interfaces with kind and speed, IPv4, RDMA
  ports, GPUs, NVLink) into a `RankTopology`.
- `cluster_topology`: `gather_topology()` collects every rank's record (JSON in tensors, no pickle) into
  a `ClusterTopology`: nodes, ranks per node, contiguity, the slowest inter-node link, `summary()`.
- `socket_interface`: `choose_socket_interface()` picks the interface for gloo / NCCL sockets, or checks
  the one GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names; `check_interface_on_all_nodes()`.
- `weight_sync`: `WeightSender` pushes the trainer's weights to rollout receivers in buckets, as lossless
  verified deltas (`delta_encoding`, `weight_plan`); `weight_receiver`: `WeightReceiver` applies them to
  a `WeightStore`; `weight_channel`: the transports (in-process, broadcast over a process group).
"""

from scalerl.comm.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.socket_interface import (SocketInterfaceChoice, SocketInterfaceError, check_interface_on_all_nodes,
                                           choose_socket_interface)
from scalerl.comm.topology import NetworkInterface, RankTopology, RdmaPort, detect_topology
from scalerl.comm.weight_channel import BroadcastChannel, InProcessChannel, WeightSyncError, serve_broadcast
from scalerl.comm.weight_receiver import TensorDictStore, WeightReceiver, WeightStore
from scalerl.comm.weight_sync import SyncReport, WeightSender

__all__ = ["BroadcastChannel", "ClusterTopology", "InProcessChannel", "NetworkInterface", "RankTopology", "RdmaPort",
           "SocketInterfaceChoice", "SocketInterfaceError", "SyncReport", "TensorDictStore", "WeightReceiver",
           "WeightSender", "WeightStore", "WeightSyncError", "check_interface_on_all_nodes", "choose_socket_interface",
           "detect_topology", "gather_topology", "serve_broadcast"]
