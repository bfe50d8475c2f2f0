"""The one formula for the bytes a rank sends in one collective: `wire_bytes`. Pure arithmetic (no torch),
so the counters, the doctor's rules and the cost model all use it.

Bytes follow from the payload size S, the group size n and the algorithm the backend runs, as bytes
*this rank sends*:

| op | per rank sends | S is |
| --- | --- | --- |
| ``all_reduce`` (ring) | 2(n-1)/n x S | the reduced tensor |
| ``all_gather`` (ring) | (n-1)/n x S | the gathered (full) output |
| ``reduce_scatter`` | ring (NCCL): (n-1)/n x S; gloo: 2(n-1)/n x S (an all-reduce underneath) | the full input |
| ``broadcast`` | gloo: binomial tree, S per child; NCCL: chain, S unless last in the chain | the tensor |
| ``send`` / ``recv`` | S / 0 | the tensor |
| ``all_to_all`` | (n-1)/n x S | this rank's input |

The gloo rows are held against the emulated network's link counters (`tests/comm/test_link_bytes.py`,
docs/comm-accounting.md): every collective kind scalerl issues, the hierarchical all-reduce's phases
included, at n = 2 and 4, to within 0.4% (TCP/IP framing) plus about 1 KB per collective.
"""

from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_to_all")


def binomial_tree_sends(relative_rank: int, n: int) -> int:
    """Children of ``relative_rank`` (distance from the root) in gloo's binomial broadcast tree: in round k
    every rank v < 2^k that has received sends to v + 2^k."""
    sends, k = 0, 0
    while (1 << k) < n:
        if relative_rank < (1 << k) and relative_rank + (1 << k) < n:
            sends += 1
        k += 1
    return sends


def wire_bytes(op: str, payload_bytes: float, group_size: int, backend: str = "gloo", group_rank: int = 0,
               root: int = 0) -> float:
    """Bytes this rank sends for one collective (the table in the module docstring). ``group_rank`` and
    ``root`` (both ranks within the group) matter only for ``broadcast``."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    n, s = group_size, float(payload_bytes)
    if n <= 1 or op == "recv":
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * s
    if op == "reduce_scatter":
        return (2 if backend == "gloo" else 1) * (n - 1) / n * s
    if op in ("all_gather", "all_to_all"):
        return (n - 1) / n * s
    if op == "broadcast":
        relative = (group_rank - root) % n
        if backend == "gloo":
            return binomial_tree_sends(relative, n) * s
        return s if relative != n - 1 else 0.0
    return s  # send


def mean_wire_bytes(op: str, payload_bytes: float, group_size: int, backend: str = "gloo") -> float:
    """`wire_bytes` averaged over the group's ranks: what differs by rank (a broadcast's tree) evens out,
    e.g. a broadcast's group sends (n-1) x S in all, whatever the tree."""
    return sum(wire_bytes(op, payload_bytes, group_size, backend, group_rank=r) for r in range(group_size)) \
        / max(1, group_size)
