"""Hierarchical all-reduce and the compressed exchanges, in one spawned world-4 gloo group on loopback
(2 "nodes" x 2 ranks by GROUP_RANK):

- hierarchical == flat, exactly, for integer-valued floats, on sizes that do and do not divide by the
  local size, in one piece and pipelined in chunks, on 2x2, 4x1 and 1x4 layouts; the node layout is
  read from GROUP_RANK;
- bytes counted per collective follow `wire_bytes` (gloo: a reduce-scatter sends as much as an all-reduce);
- top-k: every rank ends bitwise equal, sends k = ceil(density x n) elements per segment, and with error
  feedback the running sum of compressed averages tracks the dense one (the gap is exactly the mean
  residual, and shrinks relative to the sum);
- PowerSGD: equal on every rank, P and Q sizes follow the rank, error feedback converges likewise;
- bf16 / top-k / PowerSGD composed with the hierarchy stay in sync and close to the dense average.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalerl.core.net import free_port
from tests.spawned_group import start_processes

WORLD = 4


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _checks(rank: int) -> dict:
    from scalerl.comm.counting.counted_collectives import CountedCollectives
    from scalerl.comm.gradients.bucket_slots import SlotSegment
    from scalerl.comm.gradients.hierarchical import (
        HierarchicalGroups,
        NodeLayout,
        gather_node_layout,
        hierarchical_all_reduce,
    )
    from scalerl.comm.gradients.powersgd import LowRankItem, PowerSGDReducer
    from scalerl.comm.gradients.topk import TopKExchange

    out: dict = {}
    world_group = dist.group.WORLD
    layout = gather_node_layout()
    out["layout"] = layout.node_of_rank
    groups = {"2x2": HierarchicalGroups(layout), "4x1": HierarchicalGroups(NodeLayout.blocks(WORLD, 1)),
              "1x4": HierarchicalGroups(NodeLayout.blocks(WORLD, 4))}

    # -- exact sums: integer-valued floats add exactly in any order
    exact = []
    for size in (1, 7, 1000, 4097):
        gen = torch.Generator().manual_seed(1000 * size + rank)
        x = torch.randint(-1000, 1000, (size,), generator=gen).float()
        flat = x.clone()
        dist.all_reduce(flat)
        for name, g in groups.items():
            for chunks in (1, 3):  # one piece, and pipelined pieces (each padded to the local size)
                h = x.clone()
                hierarchical_all_reduce(h, g, chunks=chunks)
                exact.append((name, size, chunks, torch.equal(h, flat)))
    out["exact"] = exact

    # -- bytes: 2x2 with 4 MiB (one pipeline chunk): RS sends S on gloo (an all-reduce underneath), inter AR
    #    of S/2 over 2 ranks sends S/2, AG sends S/2
    counted = CountedCollectives()
    hierarchical_all_reduce(torch.ones(2**20), groups["2x2"], counted)
    out["hier_bytes"], _ = counted.pop()
    counted.all_reduce(torch.ones(2**20), world_group, "flat")
    out["flat_bytes"], _ = counted.pop()

    # -- top-k (flat): sync, count, error feedback
    n, density, steps = 1000, 0.05, 200
    segments = [SlotSegment(0, 0, 600), SlotSegment(1, 600, 1000)]
    exchange = TopKExchange(momentum=0.0)
    dense_sum = torch.zeros(n)
    sparse_sum = torch.zeros(n)
    gen = torch.Generator().manual_seed(rank)
    mean_grad = torch.linspace(-1, 1, n)
    synced, gaps = True, []
    for step in range(steps):
        g = mean_grad + torch.randn(n, generator=gen)
        dense = g.clone()
        dist.all_reduce(dense)
        dense_sum += dense / WORLD
        sent = g.clone() / WORLD
        counted_topk = CountedCollectives()
        exchange.reduce(sent, segments, [density, density], world_group, counted_topk, "k", "flat")
        sparse_sum += sent
        if step == 0:
            out["topk_bytes"], _ = counted_topk.pop()
        if step in (0, steps - 1):
            synced &= _same_on_all_ranks(sent)
        if step in (9, steps - 1):
            gaps.append(float((sparse_sum - dense_sum).norm() / dense_sum.norm()))
    residual = exchange.residual_of("k").clone()
    dist.all_reduce(residual)
    out["topk_synced"] = synced
    out["topk_gaps"] = gaps
    # what was not sent yet is exactly the difference (up to float rounding)
    out["topk_identity"] = float((sparse_sum + residual - dense_sum).abs().max())

    # -- DGC momentum correction: an entry never sent accumulates the momentum u_t = m u_{t-1} + g,
    #    v_T = sum_t u_t; the entry sent every step has its momentum masked (u reset), so it sends g
    for m in (0.0, 0.9):
        exchange_m = TopKExchange(momentum=m)
        g = torch.ones(100)
        g[0] = 1000.0
        for _ in range(20):
            sent = g.clone()
            exchange_m.reduce(sent, [SlotSegment(0, 0, 100)], [0.01], world_group, CountedCollectives(), "m", "flat")
        out[f"momentum_{m}"] = (float(sent[0]), float(sent[1:].abs().max()),
                                float(exchange_m.residual_of("m")[1]), float(exchange_m.residual_of("m")[0]))

    # -- PowerSGD (flat): rank respected, sync, error feedback
    rows, cols, r = 64, 48, 4
    items = [LowRankItem("w", 0, rows, cols, r), LowRankItem("b", rows * cols, 10, 1, 0)]
    reducer = PowerSGDReducer()
    low_rank_mean = torch.randn(rows, 3, generator=torch.Generator().manual_seed(7)) @ \
        torch.randn(3, cols, generator=torch.Generator().manual_seed(8))
    dense_sum = torch.zeros(rows * cols + 10)
    approx_sum = torch.zeros(rows * cols + 10)
    synced = True
    for step in range(100):
        g = torch.cat([(low_rank_mean + 0.3 * torch.randn(rows, cols, generator=gen)).reshape(-1),
                       torch.randn(10, generator=gen)])
        dense = g.clone()
        dist.all_reduce(dense)
        dense_sum += dense
        counted_p = CountedCollectives()
        reducer.reduce(g, items, world_group, counted_p, "site", "flat")
        approx_sum += g
        if step == 0:
            out["powersgd_bytes"], _ = counted_p.pop()
            synced &= _same_on_all_ranks(g)
    synced &= _same_on_all_ranks(g)
    out["powersgd_synced"] = synced
    out["powersgd_gap"] = float((approx_sum - dense_sum).norm() / dense_sum.norm())
    out["powersgd_bias_dense"] = torch.allclose(approx_sum[rows * cols:], dense_sum[rows * cols:], atol=1e-4)

    # -- composed with the hierarchy: bf16 / top-k / PowerSGD only on the inter-node part
    h = groups["2x2"]
    g = torch.randn(1001, generator=gen)
    dense = g.clone()
    dist.all_reduce(dense)

    def cast_inter(shard):
        low = shard.to(torch.bfloat16)
        dist.all_reduce(low, group=h.inter)
        return shard.copy_(low)

    bf = hierarchical_all_reduce(g.clone(), h, inter_reduce=cast_inter)
    out["hier_bf16"] = (_same_on_all_ranks(bf), float((bf - dense).abs().max() / dense.abs().max()))
    bf = hierarchical_all_reduce(g.clone(), h, inter_dtype=torch.bfloat16, chunks=2)  # pipelined cast
    out["hier_bf16_pipelined"] = (_same_on_all_ranks(bf), float((bf - dense).abs().max() / dense.abs().max()))
    start, end = h.shard_bounds(1001)
    seg = [SlotSegment(0, 0, min(end, 1001) - start)]
    ex = TopKExchange()
    tk = hierarchical_all_reduce(g.clone(), h, inter_reduce=lambda shard: ex.reduce(
        shard, seg, [1.0], h.inter, CountedCollectives(), "s", "inter"))
    out["hier_topk_dense_exact"] = (_same_on_all_ranks(tk), float((tk - dense).abs().max()))
    tk = hierarchical_all_reduce(g.clone(), h, inter_reduce=lambda shard: ex.reduce(
        shard, seg, [0.1], h.inter, CountedCollectives(), "s2", "inter"))
    out["hier_topk_synced"] = _same_on_all_ranks(tk)
    return out


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", GROUP_RANK=str(rank // 2))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results[rank] = _checks(rank)
    finally:
        dist.destroy_process_group()


def test_hierarchical_and_compressed_reductions():
    results = mp.Manager().dict()
    start_processes(_worker, (free_port(), results), WORLD)
    r = results[0]
    assert r["layout"] == (0, 0, 1, 1)
    assert all(ok for *_, ok in r["exact"]), [e for e in r["exact"] if not e[-1]]

    size = 4 * 2**20
    # gloo's reduce-scatter sends 2(n-1)/n x its input (held against the link counters, test_link_bytes.py)
    assert r["hier_bytes"] == {"reduce_scatter:intra": size, "all_reduce:inter": size // 2,
                               "all_gather:intra": size // 2}
    assert r["flat_bytes"] == {"all_reduce:flat": 2 * 3 * size // 4}

    # top-k: k = ceil(0.05 x 600) + ceil(0.05 x 400) = 50 elements, as int32 index + fp32 value, all-gathered
    k = math.ceil(0.05 * 600) + math.ceil(0.05 * 400)
    assert r["topk_bytes"] == {"all_gather:flat": 2 * 3 * k * 4}
    assert r["topk_synced"]
    early, late = r["topk_gaps"]
    assert late < 0.05 and late < early / 3, r["topk_gaps"]
    assert r["topk_identity"] < 1e-3
    sent0, others, residual, residual0 = r["momentum_0.0"]
    assert (sent0, others, residual0) == (WORLD * 1000.0, 0.0, 0.0) and abs(residual - 20.0) < 1e-4
    sent0, others, residual, residual0 = r["momentum_0.9"]
    expected = sum((1 - 0.9 ** t) / (1 - 0.9) for t in range(1, 21))  # sum of the momentum of constant 1s
    assert (sent0, others, residual0) == (WORLD * 1000.0, 0.0, 0.0) and abs(residual - expected) < 1e-3, residual

    # PowerSGD rank 4: P (64 x 4) and Q (48 x 4) all-reduced; the 10-element bias dense
    assert r["powersgd_bytes"] == {"all_reduce:flat": 2 * 3 * (10 * 4) // 4 + 2 * 3 * (64 * 4 * 4) // 4
                                   + 2 * 3 * (48 * 4 * 4) // 4}
    assert r["powersgd_synced"] and r["powersgd_bias_dense"]
    assert r["powersgd_gap"] < 0.05, r["powersgd_gap"]

    for key in ("hier_bf16", "hier_bf16_pipelined"):
        synced, err = r[key]
        assert synced and err < 1e-2, (key, err)
    synced, err = r["hier_topk_dense_exact"]
    assert synced and err < 1e-5
    assert r["hier_topk_synced"]
    for other in range(1, WORLD):
        assert results[other]["exact"] == r["exact"]
