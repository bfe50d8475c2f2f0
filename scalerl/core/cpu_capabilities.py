"""What this machine's CPU runs, asked once per process: its instruction sets, which of oneDNN's blocked
matmul kernels work on it, and a switch that turns the fast paths off so every machine can test the fallback.

Machines of one kind do not share one CPU (`shared/notes/cpu-instruction-sets.md`): an Intel Xeon with
AVX-512 and AMX multiplies bf16 about 8x faster than fp32, an AMD EPYC with AVX2 only has no bf16 matmul
instructions at all, and there oneDNN's bf16 blocked weight layout (`torch.ops.mkldnn._reorder_linear_weight`)
raises ``bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq`` while plain
bf16 ``F.linear`` runs (slowly). So nothing is assumed: the flags are read from /proc/cpuinfo (or torch's
own checks where there is no such file), and a oneDNN kernel is used only after a probe ran it on a tiny
tensor in this process.

``SCALERL_CPU_ISA`` caps what scalerl believes the CPU has, for tests and for users who want the plain
paths: ``native`` (unset: what the hardware has), ``avx2`` (as an AVX2 CPU: no AVX-512, AMX or AVX-NE-CONVERT,
so no bf16/fp16 matmul instructions and no oneDNN bf16/fp16 blocked layouts; fp32 blocked layouts stay, as
they work there), ``default`` (no vector instruction set assumed: plain tensors everywhere). It cannot give a
CPU what it lacks. ATen's own kernel dispatch has its own switch (``ATEN_CPU_CAPABILITY``), read by torch at
start; `CpuCapabilities.aten` reports it. oneDNN's environment variable ``ONEDNN_MAX_CPU_ISA`` does not make
the bf16 reorder pass or fail (measured), hence a switch of scalerl's own.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ISA_SWITCH = "SCALERL_CPU_ISA"
ISA_LEVELS = ("native", "avx2", "default")

# The flags scalerl's paths depend on, in /proc/cpuinfo's names. bf16/fp16 matmul instructions: AMX tiles
# first (the faster where both are there). oneDNN's bf16 reorder needs avx512bw+vl+dq or avx_ne_convert.
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")
FP16_MATMUL_FLAGS = ("amx_fp16", "avx512_fp16")
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert", "avx512f", "avx512bw", "avx512vl",
                  "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
# What ``avx2`` and ``default`` take away: every flag beyond AVX2 (and, for default, AVX2 and FMA too).
_BEYOND_AVX2 = ("avx512", "amx", "avx_ne_convert", "avx_vnni")
_VECTOR = ("avx", "fma", "f16c", "sse4", "ssse3")
ONEDNN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CpuIsaError(ValueError):
    """``SCALERL_CPU_ISA`` names no level."""


def isa_level(environ: dict[str, str] | None = None) -> str:
    """The level ``SCALERL_CPU_ISA`` asks for (``native`` when unset)."""
    value = (os.environ if environ is None else environ).get(ISA_SWITCH, "").strip().lower() or "native"
    if value not in ISA_LEVELS:
        raise CpuIsaError(f"{ISA_SWITCH}={value!r} is not one of {', '.join(ISA_LEVELS)} (unset = native: what "
                          "the hardware has)")
    return value


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """The CPU's model name and flags from the first processor in ``path`` (``("", set())`` where absent)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86 | arm64
            flags = set(value.split())
        if model and flags:
            break
    return model, flags


def _torch_flags() -> set[str]:
    """The flags torch's own cpuinfo checks find (where there is no /proc/cpuinfo: macOS, Windows)."""
    checks = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported", "avx512_bf16": "_is_avx512_bf16_supported",
              "amx_tile": "_is_amx_tile_supported", "amx_fp16": "_is_amx_fp16_supported", "avx512_vnni": "_is_vnni_supported"}
    found = set()
    for flag, name in checks.items():
        check = getattr(torch.cpu, name, None)
        try:
            if check is not None and check():
                found.add(flag)
        except RuntimeError:
            pass
    if "amx_tile" in found and "avx512_bf16" in found:
        found.add("amx_bf16")  # torch asks for tiles; every CPU with AMX tiles has AMX-BF16
    return found


def mask_flags(flags: set[str], level: str) -> set[str]:
    """``flags`` as a CPU of ``level`` would show them."""
    if level == "native":
        return set(flags)
    kept = {f for f in flags if not f.startswith(_BEYOND_AVX2)}
    if level == "default":
        kept = {f for f in kept if not f.startswith(_VECTOR)}
    return kept


def probe_onednn_linear(dtype: torch.dtype) -> str:
    """Run oneDNN's blocked-layout linear (`PackedLinear`'s kernel) once on a tiny ``dtype`` tensor and
    compare it with ``F.linear``: "" where it works, else why not (the kernel's own error, first line)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or mkldnn is None or not hasattr(mkldnn, "_linear_pointwise"):
        return "torch has no oneDNN (mkldnn) linear kernels"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 32, generator=generator).to(dtype)
    x = torch.randn(4, 32, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            blocked = mkldnn._reorder_linear_weight(weight, 16)
            out = mkldnn._linear_pointwise(x, blocked, None, "none", [None], "")
            plain = torch.nn.functional.linear(x, weight)
    except (RuntimeError, NotImplementedError) as error:
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not torch.allclose(out.float(), plain.float(), rtol=2e-2, atol=2e-2):
        return f"oneDNN's {dtype} blocked linear disagrees with F.linear on a probe"
    return ""


@dataclass(frozen=True)
class CpuCapabilities:
    """This process's CPU as scalerl's code paths see it (after ``SCALERL_CPU_ISA``)."""

    level: str  # SCALERL_CPU_ISA's level
    model: str  # the CPU's model name ("" where unknown)
    machine: str  # platform.machine()
    flags: tuple[str, ...]  # REPORTED_FLAGS present (masked by the level)
    aten: str  # torch's kernel dispatch level (torch.backends.cpu.get_cpu_capability())
    bf16_matmul: tuple[str, ...]  # BF16_MATMUL_FLAGS present: hardware that multiplies in bf16
    fp16_matmul: tuple[str, ...]
    onednn_linear: dict[str, str] = field(default_factory=dict)  # dtype -> "" (works) or why not

    def onednn_blocked(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's blocked weight layout runs for ``dtype`` here (probed, and allowed by the level)."""
        name = next((n for n, d in ONEDNN_DTYPES.items() if d == dtype), None)
        return name is not None and self.onednn_linear.get(name, "not probed") == ""

    def matmul_hardware(self, precision: str) -> str:
        """What multiplies in ``precision`` (bf16/fp16) on this CPU, "" where nothing does."""
        return ", ".join(self.bf16_matmul if precision == "bf16" else self.fp16_matmul if precision == "fp16" else ())

    def slow_precision_reason(self, precision: str) -> str:
        """Why ``precision`` (bf16/fp16) would run slower than fp32 here ("" where it would not: fp32, or the
        CPU multiplies in it)."""
        if precision not in ("bf16", "fp16") or self.matmul_hardware(precision):
            return ""
        wanted = BF16_MATMUL_FLAGS if precision == "bf16" else FP16_MATMUL_FLAGS
        where = self.model or self.machine
        capped = f", {ISA_SWITCH}={self.level}" if self.level != "native" else ""
        return (f"this CPU ({where}, {self.aten}{capped}) has no {precision} matmul instructions (none of "
                f"{', '.join(wanted)}): {precision} matmuls are converted to fp32 and back on every call, slower "
                "than fp32 here")

    def summary(self) -> str:
        """One line: model, dispatch level, vector flags, matmul hardware and oneDNN layouts."""
        onednn = ", ".join(f"{n} {'yes' if not why else 'no'}" for n, why in self.onednn_linear.items())
        return (f"cpu: {self.model or 'unknown model'} ({self.machine}); torch dispatch {self.aten}; "
                f"{ISA_SWITCH}={self.level}; flags: {' '.join(self.flags) or 'none of note'}; bf16 matmul: "
                f"{', '.join(self.bf16_matmul) or 'none'}; fp16 matmul: {', '.join(self.fp16_matmul) or 'none'}; "
                f"oneDNN blocked linear: {onednn}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect(level: str | None = None, cpuinfo: str | Path = "/proc/cpuinfo", probe: bool = True) -> CpuCapabilities:
    """The CPU's capabilities at ``level`` (``SCALERL_CPU_ISA`` when None); ``probe=False`` skips the oneDNN
    probes (each is a tiny matmul, well under a millisecond once torch is loaded)."""
    level = isa_level() if level is None else level
    model, flags = read_cpuinfo(cpuinfo)
    if not flags and platform.machine().lower() in ("x86_64", "amd64", "i686"):
        flags = _torch_flags()
    flags = mask_flags(flags, level)
    onednn: dict[str, str] = {}
    for name, dtype in ONEDNN_DTYPES.items():
        if level == "default":
            onednn[name] = f"{ISA_SWITCH}=default: plain layouts only"
        elif level == "avx2" and name != "fp32":
            onednn[name] = f"{ISA_SWITCH}=avx2: oneDNN's {name} blocked layout needs AVX-512 or AVX-NE-CONVERT"
        else:
            onednn[name] = probe_onednn_linear(dtype) if probe else "not probed"
    return CpuCapabilities(
        level=level, model=model, machine=platform.machine(), flags=tuple(f for f in REPORTED_FLAGS if f in flags),
        aten=torch.backends.cpu.get_cpu_capability(),
        bf16_matmul=tuple(f for f in BF16_MATMUL_FLAGS if f in flags),
        fp16_matmul=tuple(f for f in FP16_MATMUL_FLAGS if f in flags), onednn_linear=onednn)


@functools.lru_cache(maxsize=None)
def _cached(level: str) -> CpuCapabilities:
    return detect(level)


def cpu_capabilities() -> CpuCapabilities:
    """This process's capabilities, probed once per ``SCALERL_CPU_ISA`` level (a test that changes the switch
    gets the other level's answer; the hardware is asked once)."""
    return _cached(isa_level())


def main() -> int:
    """``python -m scalerl.core.cpu_capabilities``: the summary line (CI prints it first)."""
    print(cpu_capabilities().summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
