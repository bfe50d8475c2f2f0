"""Communication layer: what the network looks like, where ranks sit on it, and what they send.

- `topology`: `detect_topology()` reads one rank's node (interfaces with kind and speed, IPv4, RDMA
  ports, GPUs, NVLink) into a `RankTopology`.
- `cluster_topology`: `gather_topology()` collects every rank's record (JSON in tensors, no pickle) into
  a `ClusterTopology`: nodes, ranks per node, contiguity, the slowest inter-node link, `summary()`.
- `socket_interface`: `choose_socket_interface()` picks the interface for gloo / NCCL sockets, or checks
  the one GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names; `apply_socket_interface()` sets it before the
  process group starts; `check_interface_on_all_nodes()`.
- `rank_placement`: `plan_rank_placement()` orders the mesh so each node's ranks are contiguous.
- `accounting`: `CommCounter` (one per process, `process_counter()`): bytes each rank sends per step by
  kind and mesh dimension, and time spent waiting; `wire_bytes()` is the per-algorithm formula.
- `ddp_counting`, `fsdp_counting`, `tp_counting`: how DDP's all-reduce, FSDP2's collectives and tensor
  parallelism's DTensor collectives record themselves into a counter.
- `weight_sync`: `WeightSender` pushes the trainer's weights to rollout receivers in buckets, as lossless
  verified deltas (`delta_encoding`, `weight_plan`); `weight_receiver`: `WeightReceiver` applies them to
  a `WeightStore`; `weight_channel`: the transports (in-process, broadcast over a process group).
"""

from scalerl.comm.accounting import KINDS, CommCounter, process_counter, wire_bytes
from scalerl.comm.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.rank_placement import RankPlacement, plan_rank_placement
from scalerl.comm.socket_interface import (SocketInterfaceChoice, SocketInterfaceError, apply_socket_interface,
                                           check_interface_on_all_nodes, choose_socket_interface)
from scalerl.comm.topology import NetworkInterface, RankTopology, RdmaPort, detect_topology
from scalerl.comm.weight_channel import BroadcastChannel, InProcessChannel, WeightSyncError, serve_broadcast
from scalerl.comm.weight_receiver import TensorDictStore, WeightReceiver, WeightStore
from scalerl.comm.weight_sync import SyncReport, WeightSender

__all__ = ["KINDS", "BroadcastChannel", "ClusterTopology", "CommCounter", "InProcessChannel", "NetworkInterface",
           "RankPlacement", "RankTopology", "RdmaPort", "SocketInterfaceChoice", "SocketInterfaceError", "SyncReport",
           "TensorDictStore", "WeightReceiver", "WeightSender", "WeightStore", "WeightSyncError", "apply_socket_interface",
           "check_interface_on_all_nodes", "choose_socket_interface", "detect_topology", "gather_topology",
           "plan_rank_placement", "process_counter", "serve_broadcast", "wire_bytes"]
