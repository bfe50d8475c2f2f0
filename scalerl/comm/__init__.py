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

from scalerl.comm.accounting import KINDS, CommCounter, process_counter, wire_bytes
from scalerl.comm.allreduce_choice import AllReduceChoice, choose_allreduce
from scalerl.comm.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.counted_collectives import (
                                           CountedCollectives,
                                           SendCallback,
                                           ring_wire_bytes,
)
from scalerl.comm.gradient_reducer import (
                                           CompressionSettings,
                                           GradientReducer,
                                           gradient_reduction_hook,
                                           merged_comm_metrics,
)
from scalerl.comm.hierarchical import (
                                           HierarchicalGroups,
                                           NodeLayout,
                                           gather_node_layout,
                                           hierarchical_all_reduce,
)
from scalerl.comm.rank_placement import RankPlacement, plan_rank_placement
from scalerl.comm.reduction_setup import build_gradient_reducer
from scalerl.comm.socket_interface import (
                                           SocketInterfaceChoice,
                                           SocketInterfaceError,
                                           apply_socket_interface,
                                           check_interface_on_all_nodes,
                                           choose_socket_interface,
)
from scalerl.comm.topology import (
                                           NetworkInterface,
                                           RankTopology,
                                           RdmaPort,
                                           detect_topology,
)
from scalerl.comm.weight_channel import (
                                           BroadcastChannel,
                                           InProcessChannel,
                                           WeightSyncError,
                                           serve_broadcast,
)
from scalerl.comm.weight_receiver import TensorDictStore, WeightReceiver, WeightStore
from scalerl.comm.weight_sync import SyncReport, WeightSender

__all__ = ["KINDS", "AllReduceChoice", "apply_socket_interface", "BroadcastChannel", "build_gradient_reducer",
           "check_interface_on_all_nodes", "choose_allreduce", "choose_socket_interface", "ClusterTopology",
           "CommCounter", "CompressionSettings", "CountedCollectives", "detect_topology", "gather_node_layout",
           "gather_topology", "gradient_reduction_hook", "GradientReducer", "hierarchical_all_reduce",
           "HierarchicalGroups", "InProcessChannel", "merged_comm_metrics", "NetworkInterface", "NodeLayout",
           "plan_rank_placement", "process_counter", "RankPlacement", "RankTopology", "RdmaPort", "ring_wire_bytes",
           "SendCallback", "serve_broadcast", "SocketInterfaceChoice", "SocketInterfaceError", "SyncReport",
           "TensorDictStore", "WeightReceiver", "WeightSender", "WeightStore", "WeightSyncError", "wire_bytes"]
