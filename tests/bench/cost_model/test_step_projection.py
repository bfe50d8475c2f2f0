"""Step-time projection: compute at calibrated rates plus the alpha-beta time of the step's collectives,
checked on hand-computed cases and on a recorded emulated-network measurement."""

from __future__ import annotations

import pytest

from scalerl.bench.cost_model.collective_cost import LinkCost
from scalerl.bench.cost_model.model_shapes import model_shape
from scalerl.bench.cost_model.step_projection import (
    ComputeRates,
    Links,
    TokenLengths,
    device_memory_gb,
    phase_flops,
    project_step,
)
from scalerl.bench.cost_model.step_traffic import Layout, StepShape
from scalerl.models.config import ModelConfig

MODEL = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2)
STEP = StepShape(rows=16, prompt_len=11, response_len=16, train_width=27, micro_rows=4, mini_rows=8, pp_width=80)
LENGTHS = TokenLengths(11.0, 15.6)
# Recorded: the calibration cell of a `scalerl bench` run (1 rank, 1 thread: gen 19 ms, update 49 ms, step
# 71 ms); rates are its FLOPs over those times.
FLOPS = phase_flops(MODEL, STEP, Layout(), LENGTHS)
RATES = ComputeRates(FLOPS["gen"] / 0.019, FLOPS["update"] / 0.049, FLOPS["update"] / 0.049, 0.003 / 16)
LOOPBACK = LinkCost(9e-4, 3.39e9)
LINK_200 = LinkCost(4.6e-4, 2.39e7)  # fitted to the 200 Mbit/s emulated link's all-reduce sweep


def test_single_rank_is_compute_only():
    est = project_step(MODEL, STEP, Layout(), LENGTHS, RATES, Links(LOOPBACK, LOOPBACK))
    assert est.comm_total_s == 0
    assert est.step_s == pytest.approx(0.019 + 0.049 + 0.003)
    assert est.tokens_per_step == pytest.approx(16 * (11 + 15.6))
    assert est.tokens_per_s == pytest.approx(est.tokens_per_step / est.step_s)


def test_ddp_over_an_emulated_link_matches_the_recorded_step():
    """Recorded (2 runs): DDP, 2 nodes x 1 rank, 200 Mbit/s: step 330 / 342 ms, communication 251 / 259 ms."""
    est = project_step(MODEL, STEP, Layout(dp_replicate=2), LENGTHS, RATES, Links(LOOPBACK, LINK_200))
    assert est.comm_s["grad"] == pytest.approx(2 * (2 * LINK_200.alpha_s + 3023360 / LINK_200.bytes_per_s))
    assert est.step_s == pytest.approx(0.336, rel=0.15)
    assert est.comm_total_s == pytest.approx(0.255, rel=0.15)
    assert est.devices == 2 and est.tokens_per_step == pytest.approx(2 * 16 * 26.6)


def test_faster_links_and_contention():
    slow = project_step(MODEL, STEP, Layout(dp_shard=4), LENGTHS, RATES, Links(LOOPBACK, LINK_200))
    fast = project_step(MODEL, STEP, Layout(dp_shard=4), LENGTHS, RATES, Links(LOOPBACK, LinkCost(4.6e-4, 2.39e8)))
    assert fast.comm_total_s < slow.comm_total_s and fast.compute_total_s == slow.compute_total_s
    busy = project_step(MODEL, STEP, Layout(dp_shard=4), LENGTHS, RATES, Links(LOOPBACK, LINK_200), contention=2.0)
    assert busy.compute_total_s == pytest.approx(2 * slow.compute_total_s)
    assert busy.comm_total_s == pytest.approx(slow.comm_total_s)


def test_pipelined_transfers_pay_latency_once():
    """The replica refresh's 50 broadcasts from one owner overlap their latencies."""
    links = Links(LOOPBACK, LinkCost(1e-2, 1e12))  # all latency, no bandwidth cost
    est = project_step(MODEL, STEP, Layout(pp=2), LENGTHS, RATES, links)
    assert est.comm_s["weight_sync"] == pytest.approx(1e-2, rel=1e-3)  # one binomial round at p = 2, paid once


def test_a_collective_measured_alone_is_costed_by_its_own_fit():
    """FSDP's all-gathers and reduce-scatters over a node use their own fits where measured (gloo's do not cost
    the all-reduce's share of their bytes); other ops, and every op across nodes, the node's all-reduce fit."""
    layout = Layout(dp_shard=2, ranks_per_node=2)
    plain = project_step(MODEL, STEP, layout, LENGTHS, RATES, Links(LOOPBACK, LINK_200))
    slow_gather = LinkCost(LOOPBACK.alpha_s, LOOPBACK.bytes_per_s / 4)
    fitted = project_step(MODEL, STEP, layout, LENGTHS, RATES, Links(LOOPBACK, LINK_200, {"all_gather": slow_gather}))
    # all-gathers carry the parameters: their bandwidth term x 4, latency unchanged; the gradients' reduce-scatter
    # keeps the all-reduce fit
    gathers = [c for c in plain.collectives if (c.kind, c.op) == ("param", "all_gather")]
    bandwidth_s = sum(c.count * c.payload_bytes / 2 / LOOPBACK.bytes_per_s for c in gathers)
    assert fitted.comm_s["param"] - plain.comm_s["param"] == pytest.approx(3 * bandwidth_s, rel=1e-6)
    assert fitted.comm_s["grad"] == pytest.approx(plain.comm_s["grad"])


def test_memory_estimates_order_the_layouts():
    big = model_shape("qwen2.5-72b")
    step = StepShape(rows=64, prompt_len=256, response_len=512, train_width=768, micro_rows=4, mini_rows=32,
                     pp_width=768, act_bytes=2, param_bytes=2)
    ddp = device_memory_gb(big, step, Layout(dp_replicate=64, ranks_per_node=8))
    fsdp = device_memory_gb(big, step, Layout(dp_shard=64, ranks_per_node=8))
    tp8 = device_memory_gb(big, step, Layout(dp_shard=8, tp=8, ranks_per_node=8))
    state = 72.7e9 * (2 + 2 + 8) / 1024**3  # bf16 weights and gradients, fp32 AdamW moments
    assert ddp - fsdp == pytest.approx(state * (1 - 1 / 64), rel=0.02)  # what sharding the state saves
    assert ddp > state > 80 > tp8  # replicated it cannot fit an 80 GB device; TP also splits the activations
    small = StepShape(**{**step.__dict__, "micro_rows": 1})
    assert device_memory_gb(big, small, Layout(dp_shard=64)) < fsdp  # activations scale with the micro-batch


def test_node_link_load_counts_streams_not_ranks():
    """A DDP ring over 2 nodes x 8 ranks crosses each node boundary once: the node's link carries one rank's
    bytes; HSDP's replicate groups cross from every local rank at once: 8 streams."""
    links = Links(LinkCost(1e-6, 1e11), LinkCost(5e-6, 2.5e10))
    ddp = project_step(MODEL, STEP, Layout(dp_replicate=16, ranks_per_node=8), LENGTHS, RATES, links)
    assert ddp.node_link_bytes_per_s == pytest.approx(ddp.bytes_per_rank["grad"] / ddp.step_s, rel=0.01)
    hsdp = project_step(MODEL, STEP, Layout(dp_replicate=2, dp_shard=8, ranks_per_node=8), LENGTHS, RATES, links)
    replicate = [c for c in hsdp.collectives if c.kind == "grad" and c.op == "all_reduce"]
    assert replicate and replicate[0].group.share == 8
    assert hsdp.node_link_bytes_per_s == pytest.approx(8 * replicate[0].sent_bytes / hsdp.step_s, rel=0.01)
