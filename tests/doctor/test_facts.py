"""A rank's own facts as `collect_rank_facts` gathers them in this process: its CPU's instruction sets
(after ``SCALERL_CPU_ISA``, so every machine can be made to look like one without bf16 instructions), and
the hardware rules firing on those real facts."""

from __future__ import annotations

import torch

from scalerl.core.cpu_capabilities import ISA_SWITCH, cpu_capabilities
from scalerl.doctor.facts import collect_rank_facts
from scalerl.health.hardware_rules import cpu_precision
from scalerl.health.tree import WARNING


def test_facts_report_this_cpu_as_scalerl_sees_it(monkeypatch):
    monkeypatch.delenv(ISA_SWITCH, raising=False)
    facts = collect_rank_facts(None, [], torch.device("cpu"), environ={})
    assert facts["cpu"] == cpu_capabilities().as_dict() and facts["cpu"]["level"] == "native"
    assert set(facts["cpu"]) >= {"model", "flags", "aten", "bf16_matmul", "fp16_matmul", "onednn_linear"}
    assert facts["cpu_bf16"] == list(facts["cpu"]["bf16_matmul"])


def test_capped_at_avx2_this_process_has_no_bf16_matmul_and_bf16_is_flagged(monkeypatch):
    """Whatever this machine's CPU (AVX-512, AMX), at SCALERL_CPU_ISA=avx2 its facts say no bf16 matmul and
    the rule fires on them."""
    monkeypatch.setenv(ISA_SWITCH, "avx2")
    facts = collect_rank_facts(None, [], torch.device("cpu"), environ={ISA_SWITCH: "avx2"})
    cpu = facts["cpu"]
    assert cpu["level"] == "avx2" and cpu["bf16_matmul"] == () and cpu["fp16_matmul"] == ()
    assert not any(flag.startswith(("avx512", "amx")) for flag in cpu["flags"]) and cpu["onednn_linear"]["bf16"]
    assert facts["cpu_bf16"] == [] and facts["env"][ISA_SWITCH] == "avx2"
    settings = {"trainer.precision": "bf16", "rollout.dtype": "fp32", "rollout.engine": "builtin",
                "rollout.placement": "colocated"}
    findings = cpu_precision([facts], settings)
    (f,) = [f for f in findings if f.status == WARNING]
    assert f.summary.startswith("trainer.precision=bf16 on rank(s) 0") and f"{ISA_SWITCH}=avx2" in f.summary
    assert f.evidence["isa_level"] == "avx2" and f.fix.startswith("trainer.precision=fp32")
    assert any("plain bf16 weights" in f.summary for f in findings)  # the decode path's layout, said


def test_a_switch_naming_no_level_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv(ISA_SWITCH, "avx9")
    facts = collect_rank_facts(None, [], torch.device("cpu"), environ={})
    assert "avx9" in facts["cpu"]["error"] and facts["cpu_bf16"] == []
