"""Communication, in four wings that never import each other's internals:

- `net/`: what the network looks like and where ranks sit on it (`detect_topology`, `gather_topology`,
  `choose_socket_interface`, `plan_rank_placement`).
- `counting/`: the bytes each rank sends, by kind and mesh dimension, and the time it waits (`CommCounter`,
  `process_counter`), through one formula per collective (`wire_bytes`); how DDP's, FSDP2's and tensor
  parallelism's own collectives record themselves; `CountedCollectives` for the ones scalerl issues itself.
- `gradients/`: gradient reduction as a DDP comm hook (`GradientReducer`): flat or hierarchical all-reduce
  (`hierarchical_all_reduce`, `choose_allreduce`), top-k and PowerSGD compression, layer-adaptive plans;
  `build_gradient_reducer` builds it from the ``comm`` config.
- `weights/`: pushing the trainer's weights to rollout engines: the bucket plan, lossless verified deltas,
  the channels, `WeightSender` and `WeightReceiver`.
"""


from scalerl.comm.counting.accounting import KINDS, CommCounter, process_counter
from scalerl.comm.counting.collective_bytes import wire_bytes
from scalerl.comm.counting.counted_collectives import CountedCollectives, SendCallback
from scalerl.comm.gradients.allreduce_choice import AllReduceChoice, choose_allreduce
from scalerl.comm.gradients.hierarchical import (
                                           HierarchicalGroups,
                                           NodeLayout,
                                           gather_node_layout,
                                           hierarchical_all_reduce,
)
from scalerl.comm.gradients.reducer import (
                                           CompressionSettings,
                                           GradientReducer,
                                           gradient_reduction_hook,
                                           merged_comm_metrics,
)
from scalerl.comm.gradients.setup import build_gradient_reducer
from scalerl.comm.net.cluster_topology import ClusterTopology, gather_topology
from scalerl.comm.net.rank_placement import RankPlacement, plan_rank_placement
from scalerl.comm.net.socket_interface import (
                                           SocketInterfaceChoice,
                                           SocketInterfaceError,
                                           apply_socket_interface,
                                           check_interface_on_all_nodes,
                                           choose_socket_interface,
)
from scalerl.comm.net.topology import (
                                           NetworkInterface,
                                           RankTopology,
                                           RdmaPort,
                                           detect_topology,
)
from scalerl.comm.weights.channel import (
                                           BroadcastChannel,
                                           InProcessChannel,
                                           WeightSyncError,
                                           serve_broadcast,
)
from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver, WeightStore
from scalerl.comm.weights.sender import SyncReport, WeightSender

__all__ = ["KINDS", "AllReduceChoice", "apply_socket_interface", "BroadcastChannel", "build_gradient_reducer",
           "check_interface_on_all_nodes", "choose_allreduce", "choose_socket_interface", "ClusterTopology",
           "CommCounter", "CompressionSettings", "CountedCollectives", "detect_topology", "gather_node_layout",
           "gather_topology", "gradient_reduction_hook", "GradientReducer", "hierarchical_all_reduce",
           "HierarchicalGroups", "InProcessChannel", "merged_comm_metrics", "NetworkInterface", "NodeLayout",
           "plan_rank_placement", "process_counter", "RankPlacement", "RankTopology", "RdmaPort",
           "SendCallback", "serve_broadcast", "SocketInterfaceChoice", "SocketInterfaceError", "SyncReport",
           "TensorDictStore", "WeightReceiver", "WeightSender", "WeightStore", "WeightSyncError", "wire_bytes"]
