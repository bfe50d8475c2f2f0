"""Layer-adaptive allocation: within the byte budget, denser for sensitive tensors and for tensors whose
measured statistics ask for it; tensor kinds and bucket ranges; uniform plans and their metrics."""

import math

import pytest
import torch

from scalerl.comm.gradients.bucket_slots import (
    SlotSegment,
    TensorSlot,
    bucket_slots,
    segments_in,
    tensor_kind,
)
from scalerl.comm.gradients.compression_plan import adaptive_plan, uniform_plan
from scalerl.comm.gradients.layer_adaptive import (
    TensorStats,
    allocate_densities,
    allocate_ranks,
    measure,
)
from scalerl.comm.gradients.powersgd import powersgd_payload_bytes
from scalerl.comm.gradients.topk import topk_count, topk_payload_bytes


def test_tensor_kinds_from_names_and_shapes():
    assert tensor_kind("model.embed_tokens.weight", (100, 8)) == "embedding"
    assert tensor_kind("lm_head.weight", (100, 8)) == "head"
    assert tensor_kind("value_head.weight", (1, 8)) == "head"
    assert tensor_kind("layers.0.input_layernorm.weight", (8,)) == "norm"
    assert tensor_kind("layers.0.self_attn.q_proj.bias", (8,)) == "vector"
    assert tensor_kind("layers.0.mlp.up_proj.weight", (32, 8)) == "matrix"


def test_bucket_slots_follow_parameter_order_and_segments_cut_ranges():
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    slots = bucket_slots(params, {id(params[0]): "a.weight", id(params[1]): "a.bias"})
    assert [(s.name, s.offset, s.numel, s.kind) for s in slots] == [("a.weight", 0, 12, "matrix"),
                                                                     ("a.bias", 12, 5, "vector")]
    assert slots[0].matrix_shape == (3, 4) and slots[1].matrix_shape is None
    # a shard [10, 15) of the 17-element buffer holds the matrix's last 2 and the bias's first 3
    assert segments_in(slots, 10, 15) == [SlotSegment(0, 0, 2), SlotSegment(1, 2, 5)]


def _model_like(seed: int = 0):
    """Slots and measured stats of a small model: embedding, head, norms, biases and MLP matrices whose
    gradients have various sizes relative to their weights."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed_tokens.weight": (64, 32), "layers.0.input_layernorm.weight": (32,),
              "layers.0.q_proj.bias": (32,), "layers.0.q_proj.weight": (32, 32), "layers.0.up_proj.weight": (128, 32),
              "layers.0.down_proj.weight": (32, 128), "norm.weight": (32,), "lm_head.weight": (64, 32)}
    slots, stats, offset = [], {}, 0
    for name, shape in shapes.items():
        slot = TensorSlot(name, offset, shape, tensor_kind(name, shape))
        offset += slot.numel
        weight = torch.randn(shape, generator=gen)
        grad = torch.randn(shape, generator=gen) * (0.1 if "proj" in name else 0.3)
        stats[name] = TensorStats(slot.numel, slot.kind)
        stats[name].add(*measure(slot, grad, weight, with_ranks=True))
        slots.append(slot)
    return slots, stats


@pytest.mark.parametrize("budget", [0.02, 0.1, 0.3])
def test_topk_allocation_stays_within_budget_and_favours_sensitive_tensors(budget):
    slots, stats = _model_like()
    densities = allocate_densities(slots, stats, budget)
    spent = sum(topk_payload_bytes(s.numel, densities[s.name]) for s in slots)
    assert spent <= budget * sum(s.numel for s in slots) * 4
    assert all(densities[s.name] == 1.0 for s in slots if s.kind in ("norm", "vector"))
    matrices = [densities[s.name] for s in slots if s.kind == "matrix"]
    sensitive = [densities["embed_tokens.weight"], densities["lm_head.weight"]]
    assert min(sensitive) >= max(matrices) and sum(sensitive) / 2 > sum(matrices) / len(matrices), densities


def test_powersgd_allocation_stays_within_budget_and_favours_sensitive_tensors():
    slots, stats = _model_like()
    for budget in (0.1, 0.3):
        ranks = allocate_ranks(slots, stats, budget)
        spent = sum(powersgd_payload_bytes(*(s.matrix_shape or (s.numel, 1)), ranks[s.name]) for s in slots)
        assert spent <= budget * sum(s.numel for s in slots) * 4
        as_rank = {name: math.inf if r == 0 else r for name, r in ranks.items()}  # 0 = dense
        matrices = [as_rank[s.name] for s in slots if s.kind == "matrix"]
        sensitive = [as_rank["embed_tokens.weight"], as_rank["lm_head.weight"]]
        assert min(sensitive) >= max(matrices) and max(sensitive) > min(matrices), (budget, ranks)


def test_measured_statistics_decide_between_equal_tensors():
    """Two matrices of one shape and kind: the one with the larger gradient-to-weight ratio gets more."""
    gen = torch.Generator().manual_seed(1)
    slots = [TensorSlot("a.weight", 0, (64, 64), "matrix"), TensorSlot("b.weight", 4096, (64, 64), "matrix")]
    stats = {}
    for slot, scale in zip(slots, (1.0, 0.05)):
        stats[slot.name] = TensorStats(slot.numel, slot.kind)
        stats[slot.name].add(*measure(slot, torch.randn(64, 64, generator=gen) * scale,
                                      torch.randn(64, 64, generator=gen), with_ranks=True))
    densities = allocate_densities(slots, stats, 0.05)
    assert densities["a.weight"] > densities["b.weight"]
    ranks = allocate_ranks(slots, stats, 0.1)
    assert ranks["a.weight"] > ranks["b.weight"] or ranks["a.weight"] == 0


def test_budget_extremes():
    slots, stats = _model_like()
    assert all(d == 1.0 for d in allocate_densities(slots, stats, 1.0).values())
    tiny = allocate_densities(slots, stats, 1e-4)  # below what the dense vectors alone cost: cheapest everywhere
    assert all(topk_count(s.numel, tiny[s.name]) == 1 for s in slots if s.kind not in ("norm", "vector"))


def test_measure_energy_curves():
    slot = TensorSlot("w", 0, (4, 4), "matrix")
    grad = torch.zeros(4, 4)
    grad[0, 0], grad[1, 1] = 3.0, 1.0  # energy 9 + 1; rank 2, two entries
    rho, topk_left, rank_left = measure(slot, grad, torch.ones(4, 4), with_ranks=True)
    assert math.isclose(rho, math.sqrt(10) / 4, rel_tol=1e-6)
    assert math.isclose(topk_left[0.0625], 0.1, rel_tol=1e-6)  # k = 1 of 16 keeps the 9
    assert topk_left[0.125] < 1e-6  # k = 2 keeps both
    assert math.isclose(rank_left[1], 0.1, rel_tol=1e-5) and rank_left[2] < 1e-6


def test_plans_metrics_and_broadcast_round_trip():
    slots, stats = _model_like()
    uniform = uniform_plan("topk", slots, density=0.01, rank=4)
    assert uniform.setting("layers.0.q_proj.bias") == 1.0 and uniform.setting("lm_head.weight") == 0.01
    m = uniform.metrics()
    assert 0 < m["comm/compression/budget_used"] < 0.1
    adaptive = adaptive_plan("topk", slots, stats, 0.1)
    assert adaptive.with_vector(adaptive.as_vector()).settings == adaptive.settings
    m = adaptive.metrics()
    assert m["comm/compression/budget_used"] <= 0.1
    assert m["comm/compression/bytes_fraction/sensitive"] > m["comm/compression/bytes_fraction/matrix"]
    assert "lm_head.weight" in adaptive.describe(stats)
    low_rank = uniform_plan("powersgd", slots, density=0.01, rank=4)
    assert low_rank.setting("norm.weight") == 0 and low_rank.setting("layers.0.up_proj.weight") == 4
    assert low_rank.metrics()["comm/compression/rank/mean"] == 4


def test_a_tensor_without_statistics_gets_neutral_ones():
    slots, stats = _model_like()
    del stats["layers.0.up_proj.weight"]
    for method in ("topk", "powersgd"):
        plan = adaptive_plan(method, slots, stats, 0.1)
        assert "layers.0.up_proj.weight" in plan.settings
        assert plan.metrics()["comm/compression/budget_used"] <= 0.1
