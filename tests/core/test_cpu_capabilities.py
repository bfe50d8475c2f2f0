"""What the CPU runs, as scalerl's paths see it: the flags read from /proc/cpuinfo, the switch that caps them
(``SCALERL_CPU_ISA``), the oneDNN probes that decide the decode layout, and the one line CI prints."""

from __future__ import annotations

import pytest
import torch

from scalerl.core import cpu_capabilities as caps
from scalerl.core.cpu_capabilities import (
    CpuIsaError,
    cpu_capabilities,
    detect,
    isa_level,
    mask_flags,
    probe_onednn_linear,
    read_cpuinfo,
)

XEON = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse2 avx avx2 fma avx512f "
        "avx512bw avx512vl avx512dq avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_fp16\n\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse2 avx2\n")
EPYC_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 sse4_2 avx avx2 fma f16c\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16 sve\n"


@pytest.fixture
def cpuinfo(tmp_path):
    def write(text: str):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        return path
    return write


def test_the_switch_names_a_level_or_says_which_exist():
    assert isa_level({}) == "native" and isa_level({"SCALERL_CPU_ISA": " AVX2 "}) == "avx2"
    with pytest.raises(CpuIsaError, match="SCALERL_CPU_ISA='avx1024' is not one of native, avx2, default"):
        isa_level({"SCALERL_CPU_ISA": "avx1024"})


def test_cpuinfo_gives_the_first_processors_model_and_flags(cpuinfo, tmp_path):
    model, flags = read_cpuinfo(cpuinfo(XEON))
    assert model == "Intel(R) Xeon(R) Platinum 8480+" and {"amx_bf16", "avx512_bf16", "avx2"} <= flags
    assert read_cpuinfo(cpuinfo(ARM)) == ("", {"fp", "asimd", "bf16", "sve"})
    assert read_cpuinfo(tmp_path / "absent") == ("", set())


def test_the_levels_take_away_what_a_smaller_cpu_lacks():
    flags = {"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert", "avx_vnni"}
    assert mask_flags(flags, "native") == flags
    assert mask_flags(flags, "avx2") == {"sse2", "avx", "avx2", "fma", "f16c"}
    assert mask_flags(flags, "default") == {"sse2"}


def test_a_capped_level_reports_no_bf16_hardware_and_no_blocked_bf16_layout(cpuinfo):
    native = detect("native", cpuinfo(XEON), probe=False)
    assert native.bf16_matmul == ("amx_bf16", "avx512_bf16") and native.fp16_matmul == ("amx_fp16", "avx512_fp16")
    assert native.slow_precision_reason("bf16") == "" and native.model.startswith("Intel")
    avx2 = detect("avx2", cpuinfo(XEON), probe=False)
    assert avx2.bf16_matmul == () and "avx512f" not in avx2.flags and "avx2" in avx2.flags
    assert not avx2.onednn_blocked(torch.bfloat16) and "SCALERL_CPU_ISA=avx2" in avx2.onednn_linear["bf16"]
    reason = avx2.slow_precision_reason("bf16")
    assert "no bf16 matmul instructions" in reason and "SCALERL_CPU_ISA=avx2" in reason and "slower than fp32" in reason
    assert avx2.slow_precision_reason("fp32") == ""
    plain = detect("default", cpuinfo(EPYC_AVX2), probe=False)
    assert not any(plain.onednn_blocked(d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert "AMD EPYC 7B13" in plain.summary() and "SCALERL_CPU_ISA=default" in plain.summary()


def test_the_probes_decide_by_running_the_kernel_here():
    """The probe agrees with a direct try of the kernel (which raises on an AVX2-only CPU for bf16)."""
    for dtype in (torch.float32, torch.bfloat16):
        try:
            weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=dtype), 16)
            torch.ops.mkldnn._linear_pointwise(torch.ones(4, 32, dtype=dtype), weight, None, "none", [None], "")
            works = True
        except RuntimeError:
            works = False
        assert (probe_onednn_linear(dtype) == "") == works, dtype
    here = detect("native")
    assert here.onednn_blocked(torch.bfloat16) == (probe_onednn_linear(torch.bfloat16) == "")
    assert here.aten == torch.backends.cpu.get_cpu_capability()


def test_capabilities_are_probed_once_per_level(monkeypatch):
    calls = []
    real = caps.probe_onednn_linear
    monkeypatch.setattr(caps, "probe_onednn_linear", lambda dtype: calls.append(dtype) or real(dtype))
    caps._cached.cache_clear()
    monkeypatch.setenv("SCALERL_CPU_ISA", "native")
    first = cpu_capabilities()
    assert cpu_capabilities() is first and len(calls) == 3
    monkeypatch.setenv("SCALERL_CPU_ISA", "default")
    assert cpu_capabilities().level == "default" and len(calls) == 3  # default probes nothing: plain only
    caps._cached.cache_clear()


def test_the_module_prints_the_line_ci_shows(capsys, monkeypatch):
    monkeypatch.setenv("SCALERL_CPU_ISA", "avx2")
    assert caps.main() == 0
    line = capsys.readouterr().out
    assert line.startswith("cpu: ") and "SCALERL_CPU_ISA=avx2" in line and "oneDNN blocked linear: fp32" in line
    assert "bf16 matmul: none" in line
