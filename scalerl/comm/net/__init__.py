"""What the network looks like and where ranks sit on it.

- `topology`: `detect_topology()` reads one rank's node (interfaces with kind and speed, IPv4, RDMA ports,
  GPUs, NVLink) into a `RankTopology`;
- `cluster_topology`: `gather_topology()` collects every rank's record (JSON in tensors, no pickle) into a
  `ClusterTopology`: nodes, ranks per node, contiguity, the slowest inter-node link;
- `socket_interface`: `choose_socket_interface()` picks (or checks) the interface for gloo / NCCL sockets;
- `rank_placement`: `plan_rank_placement()` orders the mesh so each node's ranks are contiguous.
"""
