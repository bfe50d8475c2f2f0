"""Layer-adaptive ("sensitivity-aware") compression: a density (top-k) or rank (PowerSGD) per tensor, from
statistics measured on the averaged gradients of the dense warm-up steps, under a global byte budget.

Measured per tensor t:
- u_t(option): the share of the gradient's energy an option leaves out (top-k at density d: the energy
  outside the k largest entries; PowerSGD at rank r: the singular values' energy past r);
- rho_t = ||g_t|| / ||w_t||, the relative size of its update.
Allocation minimises  sum_t prior_t x rho_t^2 x u_t  (the squared relative weight perturbation the dropped
gradient would cause) subject to  sum_t bytes_t <= budget x dense fp32 bytes,  greedily: every tensor
starts at its cheapest option, then the upgrade with the best gain per extra byte is taken while it
fits. Large matrices cost the most per unit of density, so they end up sparsest.

Priors (`KIND_PRIOR`): norms and other vectors are always sent dense (a few bytes; a norm scales every
channel of its layer); embeddings and the output head weigh 4x: they feed or produce every token's
representation, so their errors are not averaged out by later layers.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from scalerl.comm.gradients.bucket_slots import TensorSlot
from scalerl.comm.gradients.powersgd import powersgd_payload_bytes
from scalerl.comm.gradients.topk import is_dense, topk_payload_bytes

KIND_PRIOR = {"embedding": 4.0, "head": 4.0, "matrix": 1.0}  # norm / vector: always dense
# Half powers of two from 2^-1.5 (0.35) to 2^-14, and dense (a sparse entry costs 2 dense ones: >= 0.5 is dense).
DENSITY_LEVELS = tuple(2.0 ** (-k / 2) for k in range(3, 29)) + (1.0,)
RANK_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
RHO_CLIP = 100.0  # rho_t is clipped to [median / 100, median x 100]: a near-zero weight norm cannot dominate
FLOAT_BYTES = 4


@dataclass
class TensorStats:
    """Running means over the warm-up steps measured so far."""

    numel: int
    kind: str
    rho: float = 0.0
    topk_left: dict[float, float] = field(default_factory=dict)  # density -> energy share left out
    rank_left: dict[int, float] = field(default_factory=dict)  # rank -> energy share left out
    steps: int = 0

    def add(self, rho: float, topk_left: dict[float, float], rank_left: dict[int, float]) -> None:
        self.steps += 1
        w = 1.0 / self.steps
        self.rho += w * (rho - self.rho)
        for table, new in ((self.topk_left, topk_left), (self.rank_left, rank_left)):
            for level, value in new.items():
                table[level] = table.get(level, value) + w * (value - table.get(level, value))


def measure(slot: TensorSlot, grad: torch.Tensor, weight: torch.Tensor, with_ranks: bool) -> tuple[float, dict, dict]:
    """(rho, top-k energy left out per density, low-rank energy left out per rank) of one averaged gradient."""
    g = grad.detach().float().reshape(-1)
    g_norm, w_norm = float(g.norm()), float(weight.detach().float().norm())
    rho = g_norm / w_norm if w_norm > 0 else math.inf
    total = g_norm ** 2
    topk_left, rank_left = {}, {}
    if slot.kind in KIND_PRIOR:
        energy = g.square().sort(descending=True).values.cumsum(0)
        for d in DENSITY_LEVELS:
            k = min(g.numel(), max(1, math.ceil(d * g.numel())))
            topk_left[d] = 0.0 if total == 0 or is_dense(d) else max(0.0, 1.0 - float(energy[k - 1]) / total)
        if with_ranks and slot.matrix_shape is not None:
            sv2 = _leading_singular_values(g.view(slot.matrix_shape)).square().cumsum(0)
            for r in RANK_LEVELS:
                if r < min(slot.matrix_shape):
                    captured = float(sv2[min(r, len(sv2)) - 1])
                    rank_left[r] = 0.0 if total == 0 else max(0.0, 1.0 - captured / total)
    return rho, topk_left, rank_left


def _leading_singular_values(m: torch.Tensor) -> torch.Tensor:
    """All singular values of a small matrix; the leading max(RANK_LEVELS) + 8 of a large one, by a
    randomized SVD (an embedding of 150k x 4k would take minutes exactly)."""
    q = max(RANK_LEVELS) + 8
    if min(m.shape) <= 2 * q:
        return torch.linalg.svdvals(m)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(0)  # svd_lowrank draws a random projection: keep the global generator untouched
    try:
        return torch.svd_lowrank(m, q=q, niter=2)[1]
    finally:
        torch.random.set_rng_state(gen_state)


def _weights(slots: list[TensorSlot], stats: dict[str, TensorStats]) -> dict[str, float]:
    rhos = [stats[s.name].rho for s in slots if s.kind in KIND_PRIOR and math.isfinite(stats[s.name].rho)]
    median = sorted(rhos)[len(rhos) // 2] if rhos else 1.0
    lo, hi = median / RHO_CLIP, median * RHO_CLIP if median > 0 else 1.0
    out = {}
    for s in slots:
        if s.kind in KIND_PRIOR:
            rho = stats[s.name].rho
            rho = median if math.isnan(rho) else hi if math.isinf(rho) else min(max(rho, lo), hi)
            out[s.name] = KIND_PRIOR[s.kind] * rho ** 2
    return out


def _greedy(options: dict[str, list[tuple[int, float, object]]], budget: float) -> tuple[dict[str, object], int]:
    """options: name -> [(bytes, weighted loss, setting)] sorted by bytes. Returns name -> setting, bytes."""
    choice = {name: 0 for name in options}
    spent = sum(opts[0][0] for opts in options.values())

    def best_upgrade(name: str):
        opts, cur = options[name], choice[name]
        cands = [((opts[cur][1] - opts[j][1]) / (opts[j][0] - opts[cur][0]), j)
                 for j in range(cur + 1, len(opts)) if opts[j][0] > opts[cur][0] and opts[j][1] < opts[cur][1]]
        return max(cands, default=None)

    heap = []  # (-gain per byte, name, current option, upgraded option); stale entries are skipped

    def push(name: str) -> None:
        up = best_upgrade(name)
        if up is not None:
            heapq.heappush(heap, (-up[0], name, choice[name], up[1]))

    for name in options:
        push(name)
    while heap:
        _, name, cur, j = heapq.heappop(heap)
        if choice[name] != cur:
            continue
        opts = options[name]
        extra = opts[j][0] - opts[cur][0]
        if spent + extra <= budget:
            choice[name], spent = j, spent + extra
            push(name)
            continue
        # Does not fit: the best cheaper upgrade of this tensor that does.
        fits = [((opts[cur][1] - opts[k][1]) / (opts[k][0] - opts[cur][0]), k) for k in range(cur + 1, j)
                if opts[k][0] > opts[cur][0] and opts[k][1] < opts[cur][1] and spent + opts[k][0] - opts[cur][0] <= budget]
        if fits:
            gain, k = max(fits)
            heapq.heappush(heap, (-gain, name, cur, k))
    return {name: options[name][i][2] for name, i in choice.items()}, spent


def allocate_densities(slots: list[TensorSlot], stats: dict[str, TensorStats], budget: float) -> dict[str, float]:
    """name -> top-k density (1.0 = dense) with sum of payload bytes <= budget x dense fp32 bytes
    (when even the cheapest settings exceed it, the cheapest settings)."""
    weights = _weights(slots, stats)
    options = {}
    for s in slots:
        if s.kind not in KIND_PRIOR:
            options[s.name] = [(s.numel * FLOAT_BYTES, 0.0, 1.0)]
            continue
        left = stats[s.name].topk_left
        opts = {}
        for d in DENSITY_LEVELS:
            cost = topk_payload_bytes(s.numel, d)
            loss = weights[s.name] * (0.0 if is_dense(d) else left.get(d, 1.0 - d))
            if cost not in opts or loss < opts[cost][1]:  # several tiny densities round to the same k
                opts[cost] = (cost, loss, d)
        options[s.name] = sorted(opts.values(), key=lambda o: o[0])
    chosen, _ = _greedy(options, budget * sum(s.numel for s in slots) * FLOAT_BYTES)
    return chosen


def allocate_ranks(slots: list[TensorSlot], stats: dict[str, TensorStats], budget: float) -> dict[str, int]:
    """name -> PowerSGD rank (0 = dense) with sum of payload bytes <= budget x dense fp32 bytes."""
    weights = _weights(slots, stats)
    options = {}
    for s in slots:
        shape = s.matrix_shape
        dense = (s.numel * FLOAT_BYTES, 0.0, 0)
        if s.kind not in KIND_PRIOR or shape is None:
            options[s.name] = [dense]
            continue
        left = stats[s.name].rank_left  # unmeasured: a flat spectrum leaves 1 - r / min(rows, cols)
        opts = [(powersgd_payload_bytes(*shape, r), weights[s.name] * left.get(r, 1 - r / min(shape)), r)
                for r in RANK_LEVELS if r < min(shape) and powersgd_payload_bytes(*shape, r) < dense[0]]
        options[s.name] = sorted(opts + [dense], key=lambda o: o[0])
    chosen, _ = _greedy(options, budget * sum(s.numel for s in slots) * FLOAT_BYTES)
    return chosen
