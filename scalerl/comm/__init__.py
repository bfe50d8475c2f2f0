"""Communication layer: what the network looks like and which interface collectives should use.

- `topology`: `detect_topology()` reads one rank's node (interfaces with kind and speed, IPv4, RDMA
  ports, GPUs, NVLink) into a `RankTopology`.
- `cluster_topology`: `gather_topology()` collects every rank's record (JSON in tensors, no pickle) into
  a `ClusterTopology`: nodes, ranks per node, contiguity, the slowest inter-node link, `summary()`.
- `socket_interface`: `choose_socket_interface()` picks the interface for gloo / NCCL sockets, or checks
  the one GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names; `check_interface_on_all_nodes()`.
- `hierarchical`: `NodeLayout`, `HierarchicalGroups`, `hierarchical_all_reduce()` (intra-node
  reduce-scatter -> inter-node all-reduce per shard -> intra-node all-gather).
- `allreduce_choice`: `choose_allreduce()` for comm.allreduce=auto|flat|hierarchical, with the reason.
- `counted_collectives`: the collectives gradient reduction uses, counting bytes sent (`on_send` callback).
- `bucket_slots`: each parameter's range and kind in a DDP bucket.
- `topk_compression` (DGC top-k, error feedback, momentum correction), `powersgd_compression` (per-tensor
  rank, error feedback), `layer_adaptive` (per-tensor settings from measured statistics under a byte
  budget), `compression_plan` (the settings in force, their metrics and log table).
- `gradient_reducer`: `GradientReducer` + `gradient_reduction_hook`, the DDP comm hook that composes
  all of the above; `reduction_setup.build_gradient_reducer()` builds it from the `comm` config.
"""

from scalerl.comm.allreduce_choice import AllReduceChoice, choose_allreduce
from scalerl.comm.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.counted_collectives import CountedCollectives, SendCallback, ring_wire_bytes
from scalerl.comm.gradient_reducer import (CompressionSettings, GradientReducer, gradient_reduction_hook,
                                           merged_comm_metrics)
from scalerl.comm.hierarchical import HierarchicalGroups, NodeLayout, gather_node_layout, hierarchical_all_reduce
from scalerl.comm.reduction_setup import build_gradient_reducer
from scalerl.comm.socket_interface import (SocketInterfaceChoice, SocketInterfaceError, check_interface_on_all_nodes,
                                           choose_socket_interface)
from scalerl.comm.topology import NetworkInterface, RankTopology, RdmaPort, detect_topology

__all__ = ["AllReduceChoice", "ClusterTopology", "CompressionSettings", "CountedCollectives", "GradientReducer",
           "HierarchicalGroups", "NetworkInterface", "NodeLayout", "RankTopology", "RdmaPort", "SendCallback",
           "SocketInterfaceChoice", "SocketInterfaceError", "build_gradient_reducer", "check_interface_on_all_nodes",
           "choose_allreduce", "choose_socket_interface", "detect_topology", "gather_node_layout",
           "gather_topology", "gradient_reduction_hook", "hierarchical_all_reduce", "merged_comm_metrics",
           "ring_wire_bytes"]
