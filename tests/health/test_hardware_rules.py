"""The hardware rules on recorded facts: bf16/fp16 asked of a CPU without the matmul instructions for it
(a warning naming the precision, the CPU and the fix), bf16 asked of a GPU without it (a fault), the
built-in engine's plain layouts (ok, said), and ranks on different hardware (a warning); hardware that
fits raises nothing."""

from __future__ import annotations

import copy

from scalerl.health import FAULT, OK, WARNING, run_cluster_rules
from scalerl.health.hardware_rules import cpu_precision, gpu_precision, mixed_hardware
from tests.health.recorded_measurements import (
    EPYC_AVX2,
    healthy_cluster_measurements,
    healthy_facts,
)

BF16 = {"trainer.precision": "bf16", "rollout.dtype": "fp32", "rollout.engine": "builtin",
        "rollout.placement": "colocated"}
FP32 = dict(BF16, **{"trainer.precision": "fp32"})


def alarms(findings) -> list:
    return [f for f in findings if f.status in (WARNING, FAULT)]


def on_epyc(facts: list[dict], ranks=(0, 1, 2, 3)) -> list[dict]:
    for f in facts:
        if f["rank"] in ranks:
            f["cpu"] = copy.deepcopy(EPYC_AVX2)
    return facts


def test_bf16_on_a_cpu_without_bf16_instructions_is_a_warning_with_the_cpu_and_the_fix():
    (f,) = alarms(cpu_precision(on_epyc(healthy_facts(nodes=2)), BF16))
    assert f.status == WARNING and f.leaf == "compute/precision" and f.ranks == (0, 1, 2, 3)
    assert f.summary.startswith("trainer.precision=bf16 on rank(s) 0-3 (node0, node1): this CPU (AMD EPYC, AVX2)")
    assert "no bf16 matmul instructions" in f.summary
    assert f.evidence["cpu_model"] == "AMD EPYC" and f.evidence["lacks"] == ["amx_bf16", "avx512_bf16"]
    assert f.evidence["torch_dispatch"] == "AVX2" and f.evidence["flags"] == ["avx2", "fma", "f16c"]
    assert f.fix.startswith("trainer.precision=fp32 (or trainer.precision=auto") and "~0.1x fp32's speed" in f.fix
    # fp32, or a CPU that multiplies in bf16, raises nothing
    assert alarms(cpu_precision(on_epyc(healthy_facts(nodes=2)), FP32)) == []
    ok = cpu_precision(healthy_facts(nodes=2), BF16)
    assert alarms(ok) == [] and "multiply in bf16 (amx_bf16, avx512_bf16)" in ok[0].summary


def test_only_the_ranks_on_the_slow_cpu_are_named_and_fp16_is_judged_by_its_own_instructions():
    (f,) = alarms(cpu_precision(on_epyc(healthy_facts(nodes=2), ranks=(2, 3)), BF16))
    assert f.ranks == (2, 3) and f.hosts == ("node1",)
    assert f.fix.startswith("trainer.precision=fp32: fp32 is faster")  # no auto: it decides per rank's CPU
    (f,) = alarms(cpu_precision(on_epyc(healthy_facts(nodes=2)), dict(BF16, **{"trainer.precision": "fp16"})))
    assert "no fp16 matmul instructions" in f.summary and f.evidence["lacks"] == ["amx_fp16", "avx512_fp16"]


def test_bf16_standalone_workers_are_judged_on_rollout_dtype_and_their_plain_layouts_said():
    standalone = dict(FP32, **{"rollout.dtype": "bf16", "rollout.placement": "standalone"})
    findings = cpu_precision(on_epyc(healthy_facts(nodes=1)), standalone)
    (f,) = alarms(findings)
    assert f.summary.startswith("rollout.dtype=bf16") and f.fix.startswith("rollout.dtype=fp32: fp32 is faster")
    (plain,) = [f for f in findings if "plain" in f.summary]
    assert plain.status == OK and "the built-in engine decodes over plain bf16 weights on rank(s) 0-3" in plain.summary
    assert "avx512bw" in plain.summary  # oneDNN's own reason
    # vLLM decodes with its own kernels: no oneDNN layout to speak of
    vllm = dict(standalone, **{"rollout.engine": "vllm"})
    assert not [f for f in cpu_precision(on_epyc(healthy_facts(nodes=1)), vllm) if "plain" in f.summary]


def test_a_cpu_isa_switch_naming_no_level_is_a_fault():
    facts = healthy_facts(nodes=1)
    facts[2]["cpu"] = {"error": "SCALERL_CPU_ISA='avx9' is not one of native, avx2, default"}
    (f,) = alarms(cpu_precision(facts, FP32))
    assert f.status == FAULT and f.ranks == (2,) and "avx9" in f.summary and "SCALERL_CPU_ISA=native" in f.fix


def test_bf16_on_a_gpu_before_compute_capability_8_is_a_fault():
    facts = healthy_facts(nodes=2)
    for f in facts:
        turing = f["hostname"] == "node1"
        f.update(device="cuda", gpus=[{"name": "Tesla T4" if turing else "NVIDIA H100 80GB HBM3", "memory_gb": 15.0,
                                       "free_gb": 14.0, "capability": "7.5" if turing else "9.0",
                                       "bf16": not turing}] * 2)
    (f,) = alarms(gpu_precision(facts, BF16))
    assert f.status == FAULT and f.ranks == (2, 3) and f.hosts == ("node1",)
    assert "Tesla T4 (compute capability 7.5) has no bf16 support" in f.summary
    assert f.fix.startswith("trainer.precision=fp16 (with its grad scaler) or trainer.precision=fp32")
    assert alarms(gpu_precision(facts, FP32)) == []
    # ... and the two GPU generations in one job are mixed hardware
    (mixed,) = alarms(mixed_hardware(facts))
    assert mixed.ranks == (2, 3)  # a tie: the ranks off the first rank's hardware are named
    assert "compute capability 7.5" in mixed.summary and "trainer.precision=fp32 explicitly" in mixed.fix


def test_ranks_on_different_cpus_are_mixed_hardware_and_one_kind_is_not():
    facts = on_epyc(healthy_facts(nodes=2), ranks=(3,))
    (f,) = alarms(mixed_hardware(facts))
    assert f.status == WARNING and f.leaf == "compute/stragglers" and f.ranks == (3,) and f.hosts == ("node1",)
    assert "AMD EPYC (avx2 fma f16c; torch dispatch AVX2) on rank(s) 3 (node1)" in f.summary
    assert "Intel(R) Xeon(R) Platinum 8480+" in f.summary and "on rank(s) 0-2 (node0, node1)" in f.summary
    # the pin that puts every rank on the least capable CPU's path
    assert "trainer.precision=fp32 explicitly (not auto)" in f.fix
    assert "export SCALERL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 on every rank" in f.fix
    assert "one kind of node" in f.fix
    assert alarms(mixed_hardware(healthy_facts(nodes=2))) == []
    assert alarms(mixed_hardware(on_epyc(healthy_facts(nodes=2)))) == []


def test_the_cluster_rules_judge_precision_only_with_a_config():
    facts, measured = on_epyc(healthy_facts(nodes=2)), healthy_cluster_measurements()
    assert alarms(run_cluster_rules(facts, measured)) == []
    (f,) = alarms(run_cluster_rules(facts, measured, BF16))
    assert f.rule == "cpu_precision"
    # facts of an older scalerl, without "cpu": nothing judged, nothing raised
    for fact in facts:
        del fact["cpu"]
    assert alarms(run_cluster_rules(facts, measured, BF16)) == []
