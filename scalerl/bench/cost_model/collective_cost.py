"""Alpha-beta cost of one collective as scalerl runs it, the links it runs over, and fitting a link to
measured timings.

A message costs ``alpha + bytes * beta`` on a link (alpha: latency per message step, beta: seconds per
byte of one stream). With ``p`` ranks, ``n`` payload bytes and ``B`` the bytes the busiest rank sends
(`scalerl.comm.counting.collective_bytes.wire_bytes`, the formula the counters use; on gloo a
reduce-scatter sends as much as an all-reduce):

| collective | message steps | time |
| --- | --- | --- |
| ring all-reduce; reduce-scatter on gloo | 2(p-1) | 2(p-1) a + B b |
| ring all-gather, all-to-all, reduce-scatter on NCCL | p-1 | (p-1) a + B b |
| broadcast, gloo binomial tree (the root sends in every round) | ceil(log2 p) | ceil(log2 p) a + B b |
| broadcast, NCCL chain (pipelined) | p-1 | (p-1) a + B b |
| send | 1 | a + B b |
| hierarchical all-reduce (G per node, N nodes) | intra reduce-scatter + inter all-reduce of n/G (G streams share each node's link) + intra all-gather | |

``share`` is how many streams of the same collective cross one node's link at once (e.g. HSDP's
replicate groups: one per rank of a node), so each stream gets ``1/share`` of the link. Gradient
compression is costed by the bytes it actually sends (the payload given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalerl.comm.counting.collective_bytes import mean_wire_bytes, wire_bytes

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "all_to_all")
LARGE_MESSAGE = 256 * 2**10  # fit_link: bandwidth from messages this large or larger


@dataclass(frozen=True)
class LinkCost:
    """One stream's latency and bandwidth over a link, and where the numbers came from."""

    alpha_s: float
    bytes_per_s: float
    source: str = ""

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bytes_per_s

    def to_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "bytes_per_s": self.bytes_per_s, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> LinkCost:
        return cls(float(data["alpha_s"]), float(data["bytes_per_s"]), str(data.get("source", "")))


# Nominal line rates (the standards' figures) with an assumed per-message latency: a starting point for
# clusters nobody has measured; `scalerl doctor --distributed-check --json` on the cluster gives the
# achieved figures (pass it as the calibration instead).
GBIT = 1e9 / 8
LINK_PRESETS: dict[str, LinkCost] = {
    "ib-ndr": LinkCost(5e-6, 400 * GBIT, "nominal InfiniBand NDR 400 Gbit/s, latency 5 us assumed"),
    "ib-hdr": LinkCost(5e-6, 200 * GBIT, "nominal InfiniBand HDR 200 Gbit/s, latency 5 us assumed"),
    "100gbe": LinkCost(20e-6, 100 * GBIT, "nominal 100 Gbit Ethernet, latency 20 us assumed"),
    "25gbe": LinkCost(30e-6, 25 * GBIT, "nominal 25 Gbit Ethernet, latency 30 us assumed"),
    "nvlink4": LinkCost(3e-6, 450e9, "nominal NVLink 4 (H100) 450 GB/s per direction, latency 3 us assumed"),
    "nvlink3": LinkCost(3e-6, 300e9, "nominal NVLink 3 (A100) 300 GB/s per direction, latency 3 us assumed"),
    "pcie4": LinkCost(5e-6, 32e9, "nominal PCIe 4.0 x16 32 GB/s per direction, latency 5 us assumed"),
    "pcie5": LinkCost(5e-6, 64e9, "nominal PCIe 5.0 x16 64 GB/s per direction, latency 5 us assumed"),
}


def sent_bytes(op: str, payload_bytes: float, p: int, backend: str = "gloo") -> float:
    """Bytes each rank sends for one collective (the mean over ranks for a broadcast), by the one formula
    (`scalerl.comm.counting.collective_bytes`)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    if op == "broadcast":  # every non-root receives the payload once: (p-1) x payload sent by the group
        return mean_wire_bytes(op, payload_bytes, p, backend)
    return wire_bytes(op, payload_bytes, p, backend)


def _steps_and_factor(op: str, p: int, backend: str) -> tuple[float, float]:
    """(message steps, bytes per unit payload the busiest rank sends) of ``op`` over ``p`` ranks. The bytes
    are `wire_bytes` of the root (a broadcast's busiest rank; every rank alike otherwise); the step counts
    are latency terms of the algorithms, not bytes."""
    factor = wire_bytes(op, 1.0, p, backend, group_rank=0, root=0)
    if op == "all_reduce" or (op == "reduce_scatter" and backend == "gloo"):  # gloo: an all-reduce underneath
        return 2 * (p - 1), factor  # ring: reduce-scatter then all-gather, p - 1 steps each
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return p - 1, factor
    if op == "broadcast":
        # gloo's binomial tree: ceil(log2 p) rounds, the root sending in each; NCCL's chain: p - 1 hops
        return (math.ceil(math.log2(p)) if backend == "gloo" else p - 1), factor
    return 1, factor  # send


def collective_time(op: str, payload_bytes: float, p: int, link: LinkCost, backend: str = "gloo",
                    share: int = 1) -> float:
    """Seconds for one ``op`` of ``payload_bytes`` over ``p`` ranks on ``link`` (see the module table)."""
    if p <= 1:
        return 0.0
    steps, factor = _steps_and_factor(op, p, backend)
    return steps * link.alpha_s + factor * payload_bytes * link.beta_s_per_byte * max(1, share)


def hierarchical_all_reduce_time(payload_bytes: float, nodes: int, per_node: int, intra: LinkCost,
                                 inter: LinkCost, backend: str = "gloo") -> float:
    """Reduce-scatter inside each node, all-reduce of each rank's 1/G part among same-local-rank peers of
    the other nodes (G such streams share a node's link), all-gather inside the node."""
    # gloo's reduce-scatter costs an all-reduce (`wire_bytes`), as `hierarchical_all_reduce` counts it
    within = (collective_time("reduce_scatter", payload_bytes, per_node, intra, backend)
              + collective_time("all_gather", payload_bytes, per_node, intra, backend))
    across = collective_time("all_reduce", payload_bytes / per_node, nodes, inter, backend, share=per_node)
    return within + across


def fit_link(sizes: list[float], seconds: list[float], op: str = "all_reduce", p: int = 2,
             backend: str = "gloo", source: str = "") -> LinkCost:
    """The link whose alpha-beta cost of ``op`` over ``p`` ranks fits ``seconds`` measured at payload ``sizes``.

    Bandwidth from the large messages, latency from the small ones, so neither end's noise spoils the other:
    beta is the least-squares slope through the sizes of at least 256 KiB (all sizes when fewer than two are
    that large), alpha the median over the sizes under 256 KiB of what is left once the bandwidth term is
    taken off, per message step, clamped at 0."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fit_link needs at least two (size, seconds) points")
    if len(set(sizes)) < 2 or min(seconds) <= 0:
        raise ValueError("fit_link needs at least two different sizes and positive times")
    steps, factor = _steps_and_factor(op, p, backend)
    points = sorted(zip(sizes, seconds))
    large = [(x, y) for x, y in points if x >= LARGE_MESSAGE] if sum(x >= LARGE_MESSAGE for x, _ in points) >= 2 \
        else points
    mean_x = sum(x for x, _ in large) / len(large)
    mean_y = sum(y for _, y in large) / len(large)
    sxx = sum((x - mean_x) ** 2 for x, _ in large)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in large) / sxx if sxx else 0.0
    if slope <= 0:  # flat or noisy: the largest message's rate
        slope = large[-1][1] / large[-1][0]
    small = [(x, y) for x, y in points if x < LARGE_MESSAGE] or points[:1]
    residuals = sorted(max(0.0, y - slope * x) for x, y in small)
    alpha = residuals[len(residuals) // 2] / steps
    return LinkCost(alpha, factor / slope, source)


def fit_error(link: LinkCost, sizes: list[float], seconds: list[float], op: str = "all_reduce", p: int = 2,
              backend: str = "gloo") -> float:
    """Largest relative error of the fitted link's predictions over the points (how well it fits)."""
    return max(abs(collective_time(op, s, p, link, backend) - t) / t for s, t in zip(sizes, seconds) if t > 0)
