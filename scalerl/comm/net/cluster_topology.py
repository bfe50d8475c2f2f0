"""The job's topology from every rank's record: nodes, rank placement, the slowest inter-node link.

`gather_topology` collects the records as JSON bytes in tensors rather than with `all_gather_object`,
which unpickles what other ranks send.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from scalerl.comm.net.topology import NetworkInterface, RankTopology, detect_topology


@dataclass(frozen=True)
class ClusterTopology:
    records: tuple[RankTopology, ...]

    def __post_init__(self):
        ranks = [r.rank for r in self.records]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate ranks in topology records: {sorted(ranks)}")

    @classmethod
    def from_records(cls, records) -> ClusterTopology:
        return cls(tuple(sorted(records, key=lambda r: r.rank)))

    @classmethod
    def from_json_records(cls, texts) -> ClusterTopology:
        return cls.from_records(RankTopology.from_json(t) for t in texts)

    def to_json_records(self) -> list[str]:
        return [r.to_json() for r in self.records]

    @property
    def world_size(self) -> int:
        return len(self.records)

    @property
    def node_of_rank(self) -> list[str]:
        """The node name of every rank, by rank. A node is a hostname and the IPv4 addresses its ranks
        see: ranks in one network namespace share both. Two namespaces of one host (containers, the
        emulated cluster) are two nodes, named ``host[first address]``; their traffic crosses a link."""
        keys = [(r.hostname, _addresses(r)) for r in self.records]
        hosts_with_many = {h for h in dict.fromkeys(h for h, _ in keys)
                           if len({k for k in keys if k[0] == h}) > 1}
        return [f"{h}[{a[0] if a else 'no address'}]" if h in hosts_with_many else h for h, a in keys]

    @property
    def nodes(self) -> list[str]:
        """Node names (hostnames, see `node_of_rank`) in the order of their lowest rank."""
        return list(dict.fromkeys(self.node_of_rank))

    @property
    def ranks_per_node(self) -> dict[str, list[int]]:
        placement: dict[str, list[int]] = {host: [] for host in self.nodes}
        for record, node in zip(self.records, self.node_of_rank):
            placement[node].append(record.rank)
        return placement

    @property
    def contiguous(self) -> bool:
        """Each node holds a run of consecutive ranks (0-3 / 4-7), what intra-node groups assume."""
        return all(ranks == list(range(ranks[0], ranks[0] + len(ranks))) for ranks in self.ranks_per_node.values())

    def node_record(self, host: str) -> RankTopology:
        """One record of the node (its lowest rank's): all ranks of a node see the same interfaces."""
        return next(r for r, node in zip(self.records, self.node_of_rank) if node == host)

    def best_link(self, host: str) -> NetworkInterface | None:
        """The node's fastest interface that can leave the machine; None when no speed is readable."""
        links = [i for i in self.node_record(host).interfaces
                 if i.is_physical_link and i.up and i.speed_mbit is not None]
        return max(links, key=lambda i: i.speed_mbit, default=None)

    @property
    def slowest_inter_node_mbit(self) -> int | None:
        """min over nodes of their best link's speed; None (unknown) if any node's speed is unreadable."""
        best = [self.best_link(host) for host in self.nodes]
        return None if any(b is None for b in best) else min(b.speed_mbit for b in best)

    def summary(self) -> str:
        placement = self.ranks_per_node
        lines = [f"{self.world_size} ranks on {len(self.nodes)} node(s); ranks per node "
                 f"{'contiguous' if self.contiguous else 'NOT contiguous (intra-node groups will span nodes)'}"]
        for host in self.nodes:
            record, best = self.node_record(host), self.best_link(host)
            link = f"{best.name} {best.kind} {_speed(best.speed_mbit)}" if best else "no link with a readable speed"
            gpus = f"{len(record.gpus)} GPU(s) ({', '.join(sorted(set(record.gpus)))})" if record.gpus else "no GPU"
            lines.append(f"  {host}: ranks {_ranges(placement[host])}; best link {link}; {gpus}; "
                         f"NVLink {record.nvlink}")
            for iface in record.interfaces:
                extra = f" ({iface.virtual_kind})" if iface.virtual_kind else ""
                flags = " link-local" if iface.link_local else ""
                flags += "" if iface.up else " down"
                lines.append(f"    {iface.name}: {iface.kind}{extra} {_speed(iface.speed_mbit)} "
                             f"{' '.join(iface.ipv4) or 'no IPv4'}{flags}")
        slowest = self.slowest_inter_node_mbit
        lines.append("slowest inter-node link: " + ("unknown (a node's link speed is unreadable)" if slowest is None
                                                    else _speed(slowest)))
        return "\n".join(lines)


def gather_topology(group=None, record: RankTopology | None = None) -> ClusterTopology:
    """All ranks' records, on every rank (a collective: call it on all ranks of `group`)."""
    record = detect_topology() if record is None else record
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    payload = torch.tensor(list(record.to_json().encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    texts = [bytes(g[: int(n.item())].cpu().tolist()).decode() for g, n in zip(gathered, sizes)]
    return ClusterTopology.from_json_records(texts)


def _addresses(record: RankTopology) -> tuple[str, ...]:
    return tuple(sorted(a for i in record.interfaces if i.kind != "loopback" for a in i.ipv4))


def _speed(mbit: int | None) -> str:
    if mbit is None:
        return "speed unknown"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit} Mbit/s"


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)
