"""The step's collectives against what the byte accounting recorded (recorded measurements, no spawning).

The recorded figures are ``comm/bytes/<kind>`` per step of `scalerl bench` cells (the built-in model at 4
layers, hidden 128, 4 prompts x 4 samples per DP rank, 16 new tokens, micro-batches of 4, 2 optimizer
steps per step; mean prompt 11 tokens, every response 16 tokens long), under each layout."""

from __future__ import annotations

import pytest

from scalerl.bench.cost_model.step_traffic import (
    GroupPlacement,
    Layout,
    StepShape,
    bytes_by_kind,
    step_collectives,
)
from scalerl.models.config import ModelConfig

MODEL = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2)
STEP = StepShape(rows=16, prompt_len=11, response_len=16, train_width=27, micro_rows=4, mini_rows=8, pp_width=80,
                 pp_microbatches=4)

# (layout, recorded bytes per step per rank by kind, tolerance)
RECORDED = {
    "ddp 2": (Layout(dp_replicate=2), {"grad": 6046720}, 0.001),
    "ddp 4": (Layout(dp_replicate=4), {"grad": 9070080}, 0.001),
    # FSDP's param bytes re-recorded once generation gathered each unit once per `generate` (before: 36,280,320
    # / 54,420,480 / 36,280,320, a gather per decode step), and again once the root unit stayed gathered from
    # forward to backward (before: 13,605,120 / 20,407,680 / 13,605,120).
    "fsdp 2": (Layout(dp_shard=2), {"param": 13473024, "grad": 12093440}, 0.001),
    "fsdp 4 (2 per node)": (Layout(dp_shard=4, ranks_per_node=2), {"param": 20209536, "grad": 18140160}, 0.001),
    "hsdp 2x2": (Layout(dp_replicate=2, dp_shard=2, ranks_per_node=2), {"param": 13473024, "grad": 18140160}, 0.001),
    # TP re-recorded once the attention and MLP blocks all-reduced their input gradient once each (before:
    # 7,897,088 in both, with q/k/v and gate/up reducing their own).
    "tp 2": (Layout(tp=2), {"tp": 5242880}, 0.001),
    "tp2 x dp2": (Layout(dp_replicate=2, tp=2, ranks_per_node=2), {"tp": 5210112, "grad": 6187008}, 0.03),
    "pp 2": (Layout(pp=2), {"pp": 657920, "weight_sync": 1511680, "grad": 131072}, 0.005),
    "pp2 x dp2": (Layout(dp_replicate=2, pp=2, ranks_per_node=2), {"pp": 657920, "weight_sync": 1511680,
                                                                    "grad": 3219968}, 0.03),
    # pipeline stages sharded by FSDP (recorded from a `pp2+fsdp` cell on one node of 4 ranks)
    "pp2 x fsdp2": (Layout(pp=2, dp_shard=2), {"pp": 657920, "weight_sync": 2283904, "grad": 3154432,
                                              "param": 7459072}, 0.01),
}


@pytest.mark.parametrize("name", list(RECORDED))
def test_bytes_match_the_accounting(name):
    layout, recorded, tolerance = RECORDED[name]
    modelled = bytes_by_kind(step_collectives(MODEL, STEP, layout))
    for kind, value in recorded.items():
        assert modelled.get(kind, 0.0) == pytest.approx(value, rel=tolerance), kind
    assert set(modelled) - {"metrics"} == set(recorded)


def test_standalone_workers_take_generation_off_the_trainers():
    """FSDP trainers with fp32 rollout workers gather for training only (recorded: 17,942,016 param bytes at
    dp_shard=4, against 20,209,536 when they generate)."""
    step = STEP
    layout = Layout(dp_shard=4, ranks_per_node=2, rollout_workers=2)
    modelled = bytes_by_kind(step_collectives(MODEL, step, layout))
    assert modelled["param"] == pytest.approx(17942016)
    assert modelled["weight_sync"] > 0


def test_group_placement_follows_the_mesh_order():
    layout = Layout(dp_replicate=2, dp_shard=2, tp=2, ranks_per_node=4)  # 2 nodes x 4 ranks
    assert layout.placement("tp") == GroupPlacement(2, nodes=1, share=1)  # innermost: inside a node
    assert layout.placement("dp_shard") == GroupPlacement(2, nodes=1, share=1)
    assert layout.placement("dp_replicate") == GroupPlacement(2, nodes=2, share=4)  # every local rank crosses
    ddp = Layout(dp_replicate=4, ranks_per_node=2)
    assert ddp.placement("dp_replicate") == GroupPlacement(4, nodes=2, share=1)  # one ring, node by node
    assert Layout(dp_replicate=8).placement("dp_replicate") == GroupPlacement(8, nodes=8, share=1)


def test_compression_and_hierarchical_all_reduce():
    dense = bytes_by_kind(step_collectives(MODEL, STEP, Layout(dp_replicate=4, ranks_per_node=2)))["grad"]
    half = bytes_by_kind(step_collectives(MODEL, STEP, Layout(dp_replicate=4, ranks_per_node=2, grad_ratio=0.5)))
    assert half["grad"] == pytest.approx(dense / 2)
    flat = step_collectives(MODEL, STEP, Layout(dp_replicate=4, ranks_per_node=2))
    hier = step_collectives(MODEL, STEP, Layout(dp_replicate=4, ranks_per_node=2, allreduce="hierarchical"))
    assert not any(c.hierarchical for c in flat) and any(c.hierarchical for c in hier)
    one_node = step_collectives(MODEL, STEP, Layout(dp_replicate=2, ranks_per_node=2, allreduce="hierarchical"))
    assert not any(c.hierarchical for c in one_node)  # nothing crosses a node: nothing to do hierarchically


def test_pipeline_ranks_split_generation_from_16_rows_each():
    """16 rows per DP rank (8 per pipeline rank) are generated whole on every rank; from 32 the two pipeline
    ranks split them and exchange the outputs, rows x (16 B per prompt token + 24 B per response token + 1)
    + a 232-byte header per rank (the per-token policy versions added 4 B per response token and one tensor to
    the header since the formula gave exactly the 4,176 bytes recorded from a `pp` cell with 8 rows per rank,
    while the split still started at one row per rank)."""
    from dataclasses import replace

    assert "rollout" not in bytes_by_kind(step_collectives(MODEL, STEP, Layout(pp=2)))
    wide = replace(STEP, rows=32, mini_rows=16)
    assert bytes_by_kind(step_collectives(MODEL, wide, Layout(pp=2)))["rollout"] == 16 * (16 * 11 + 24 * 16 + 1) + 232


def test_the_constants_it_mirrors_come_from_the_code():
    """The message header and the per-layer tensor count the model uses are the code's own: a real encoded
    generation output's header, and the built models' parameters per layer (Qwen2 with q/k/v bias, Llama)."""
    import torch

    from scalerl.bench.cost_model.step_traffic import ROLLOUT_HEADER_BYTES
    from scalerl.models.decoder import build_model
    from scalerl.perf.flops import decoder_layer_tensor_count
    from scalerl.rollout.engines.engine import GenerationOutput
    from scalerl.rollout.worker.messages import _header
    from scalerl.rollout.worker.protocol import encode_output

    out = GenerationOutput(torch.zeros(3, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.long),
                           torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4), torch.zeros(3, 4),
                           ["stop", "length", "stop"])
    header = _header(encode_output(out))
    assert ROLLOUT_HEADER_BYTES == 8 * (1 + header.numel())  # the length slot, then the header itself
    for cfg in (ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2),
                ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, model_type="llama", attention_bias=False)):
        layer = build_model(cfg, seed=0).layers[0]
        assert decoder_layer_tensor_count(cfg) == len(list(layer.parameters())), cfg.model_type


def test_sequence_parallel_traffic_follows_the_code():
    """Ulysses' bytes: one training micro-batch of 3 x 13 tokens (padded to 16) on the tiny model at sp=4 sent
    18,720 ``sequence`` bytes per rank in `tests/parallel/test_sequence_parallel.py` (18,432 all-to-all, 288
    all-gather: 2 float32 per-token results, the head runs on each shard); gradients reduce over dp x sp, as
    DDP 4 / FSDP 4 would; generation adds nothing."""
    tiny = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)
    one_micro = StepShape(rows=3, prompt_len=5, response_len=8, train_width=13, micro_rows=3, mini_rows=3)
    modelled = bytes_by_kind(step_collectives(tiny, one_micro, Layout(sp=4)))
    assert modelled["sequence"] == pytest.approx(18720)
    assert modelled["grad"] == pytest.approx(bytes_by_kind(step_collectives(tiny, one_micro, Layout(dp_replicate=4)))["grad"])
    fsdp = bytes_by_kind(step_collectives(MODEL, STEP, Layout(dp_shard=2, sp=2)))
    assert fsdp["grad"] == pytest.approx(bytes_by_kind(step_collectives(MODEL, STEP, Layout(dp_shard=4)))["grad"])
    assert "sequence" not in bytes_by_kind(step_collectives(MODEL, STEP, Layout(dp_shard=2)))
    with_passes = StepShape(rows=3, prompt_len=5, response_len=8, train_width=13, micro_rows=3, mini_rows=3,
                            forward_passes=2)  # two forward-only passes: half a training micro-batch's all-to-alls each,
    # and one per-token result (a log-prob or a value) gathered
    assert bytes_by_kind(step_collectives(tiny, with_passes, Layout(sp=4)))["sequence"] == pytest.approx(
        18720 + 2 * (18432 / 2 + 144))
