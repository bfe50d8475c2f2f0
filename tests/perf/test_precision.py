"""trainer.precision=auto's choice: the CPU's bf16 flags, the probe's ratio against the threshold, the reason
it gives, ranks agreeing on one measurement, and the doctor's inputs."""

from __future__ import annotations

import torch

from scalerl.models.config import ModelConfig
from scalerl.perf import precision
from scalerl.perf.precision import (
    AUTO_MIN_SPEEDUP,
    bf16_matmul_speedup,
    choose_precision,
    cpu_bf16_features,
)

CPU = torch.device("cpu")
MODEL = ModelConfig(vocab_size=96, hidden_size=256, intermediate_size=688, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)  # the small model's MLP: 180 MFLOP at 512 rows
DEMO = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=352, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)  # the demo's: 46 MFLOP
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2)  # the tests' run model: 2 MFLOP


def test_cpu_flags_name_the_bf16_instruction_sets(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALERL_CPU_ISA", "native")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_features(info) == ["amx_bf16", "avx512_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_bf16_features(info) == []
    assert cpu_bf16_features(tmp_path / "absent") == []
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    monkeypatch.setenv("SCALERL_CPU_ISA", "avx2")  # the switch: as an AVX2 CPU would, whatever this one has
    assert cpu_bf16_features(info) == [] and cpu_bf16_features() == []


def test_bf16_on_a_cpu_without_bf16_instructions_runs_and_says_it_is_slower(monkeypatch):
    """Requested bf16 is kept (it runs: autocast converts per call), with the reason said once at start;
    an fp32 run, or auto, is not warned."""
    monkeypatch.setenv("SCALERL_CPU_ISA", "avx2")
    choice = choose_precision("bf16", CPU, MODEL)
    assert choice.precision == "bf16" and choice.slow and choice.hardware == ""
    assert "no bf16 matmul instructions" in choice.reason and "trainer.precision=fp32 (or auto)" in choice.reason
    assert not choose_precision("fp32", CPU, MODEL).slow
    auto = choose_precision("auto", CPU, MODEL)
    assert auto.precision == "fp32" and not auto.slow and "no bf16 matmul hardware" in auto.reason


def test_auto_is_fp32_without_bf16_hardware(monkeypatch):
    monkeypatch.setattr(precision, "bf16_hardware", lambda device: "")
    choice = choose_precision("auto", CPU, MODEL)
    assert choice.precision == "fp32" and "no bf16 matmul hardware" in choice.reason
    assert choice.health_context() == {"precision": "fp32", "bf16_hardware": ""}


def test_auto_follows_the_probe_against_the_threshold(monkeypatch):
    monkeypatch.setattr(precision, "bf16_hardware", lambda device: "avx512_bf16")
    shapes = []

    def probe(speedup):
        def measure(device, rows, inner, outer):
            shapes.append((rows, inner, outer))
            return speedup
        return measure

    monkeypatch.setattr(precision, "bf16_matmul_speedup", probe(3.2))
    fast = choose_precision("auto", CPU, MODEL)
    assert fast.precision == "bf16" and "at 3.20x fp32's speed" in fast.reason and "avx512_bf16" in fast.reason
    assert shapes[-1] == (precision.PROBE_ROWS, 256, 688)  # the model's own MLP
    # a tiny model stays fp32 however fast its bf16 matmul: overhead, not matmuls, sets its step
    tiny = choose_precision("auto", CPU, TINY)
    assert tiny.precision == "fp32" and "2 MFLOP" in tiny.reason and tiny.health_context()["bf16_pays"] is False
    assert choose_precision("auto", CPU, DEMO).precision == "bf16"  # measured 1.39x per step in bf16
    monkeypatch.setattr(precision, "bf16_matmul_speedup", probe(AUTO_MIN_SPEEDUP - 0.2))
    slow = choose_precision("auto", CPU, MODEL)
    assert slow.precision == "fp32" and f"under the {AUTO_MIN_SPEEDUP}x" in slow.reason
    # ranks agree on one number (the minimum): one rank's slow probe keeps every rank in fp32
    monkeypatch.setattr(precision, "bf16_matmul_speedup", probe(3.2))
    assert choose_precision("auto", CPU, MODEL, agree=lambda mine: 1.0).precision == "fp32"
    # an fp32 run is probed too (the doctor's evidence); an explicit bf16/fp16 is left alone, unprobed
    fp32 = choose_precision("fp32", CPU, MODEL)
    assert fp32.precision == "fp32" and fp32.health_context()["bf16_over_fp32"] == 3.2
    calls = len(shapes)
    assert choose_precision("bf16", CPU, MODEL).precision == "bf16" and len(shapes) == calls
    assert choose_precision("fp16", CPU, MODEL).precision == "fp16"
    assert fast.requested == "auto" and fp32.requested == "fp32"


def test_auto_weighs_the_whole_step_an_old_logprob_recompute_included(monkeypatch):
    monkeypatch.setattr(precision, "bf16_hardware", lambda device: "avx512_bf16")
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device, rows, inner, outer: 3.2)
    why = "rollout.engine=vllm generates in its own numerics"
    recomputing = choose_precision("auto", CPU, MODEL, recompute_under_bf16=why)
    assert recomputing.precision == "fp32" and why in recomputing.reason and "at 3.20x" in recomputing.reason
    assert recomputing.health_context()["bf16_pays"] is False
    assert choose_precision("auto", CPU, MODEL, recompute_under_bf16=None).precision == "bf16"
    # an explicit choice stays as configured; an fp32 one is not bf16 left unused (the doctor's evidence)
    assert choose_precision("bf16", CPU, MODEL, recompute_under_bf16=why).precision == "bf16"
    fp32 = choose_precision("fp32", CPU, MODEL, recompute_under_bf16=why)
    assert fp32.precision == "fp32" and fp32.health_context()["bf16_pays"] is False
    assert choose_precision("fp32", CPU, MODEL).health_context()["bf16_pays"] is True


def test_the_probe_measures_a_positive_ratio():
    assert bf16_matmul_speedup(CPU, 16, 32, 48, repeats=1) > 0


def test_a_rank_without_bf16_hardware_still_joins_the_ranks_agreement(monkeypatch):
    """In a job of mixed CPUs the ranks with bf16 instructions all-reduce their probe's ratio (`agree`): a rank
    without them must join that collective (with 0: no speed-up), or the others wait for it forever."""
    monkeypatch.setattr(precision, "bf16_hardware", lambda device: "")
    offered = []
    for requested in ("auto", "fp32"):
        choice = choose_precision(requested, CPU, MODEL, agree=lambda ratio: offered.append(ratio) or ratio)
        assert choice.precision == "fp32"
    assert offered == [0.0, 0.0]
    choose_precision("bf16", CPU, MODEL, agree=offered.append)  # as configured: no rank probes, none agrees
    assert offered == [0.0, 0.0]
    monkeypatch.setattr(precision, "bf16_hardware", lambda device: "avx512_bf16")
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device, rows, inner, outer: 3.0)
    mixed = choose_precision("auto", CPU, MODEL, agree=lambda ratio: min(ratio, 0.0))  # the other rank's 0 wins
    assert mixed.precision == "fp32"
