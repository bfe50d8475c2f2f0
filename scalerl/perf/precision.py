"""Which precision a run's matmuls pay in: the CPU's bf16 instructions, a probe of bf16 against fp32 on the
model's own matmul shape, and `trainer.precision=auto`'s choice with the reason it gives.

On a CPU, bf16 pays only where the hardware multiplies in it (``avx512_bf16``, ``amx_bf16`` in
/proc/cpuinfo) and the model's matmuls are large enough for that to outweigh autocast's casts and its
extra ops per layer. The probe times the MLP's up-projection, ``[rows, hidden] @ [hidden, intermediate]``,
in fp32 against bf16 with the weight cast included (autocast casts once per pass), so its ratio is what a
pass over one micro-batch can gain at most. On CUDA devices with bf16 support the tensor cores decide it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from scalerl.core.cpu_capabilities import BF16_MATMUL_FLAGS, cpu_capabilities, isa_level, mask_flags, read_cpuinfo
from scalerl.models.config import ModelConfig
from scalerl.perf.flops import device_peak_flops

CPU_BF16_FLAGS = BF16_MATMUL_FLAGS  # AMX tiles first: the faster of the two where both are there
PROBE_ROWS = 512  # about one micro-batch of tokens
# auto picks bf16 at this probe ratio or more: the matmuls are about half a small model's step, the rest
# (norms, softmax, the optimizer) does not speed up, so below ~1.5x the step gains little or loses.
AUTO_MIN_SPEEDUP = 1.5
# ... and only for a model whose MLP matmul over PROBE_ROWS tokens is at least this many FLOPs. Below it
# per-op overhead, not the matmuls, sets the step. Measured on an AVX-512 BF16 EPYC (no AMX), whole RL step in
# CPU seconds, the engine decoding in bf16 and no old-log-prob recompute (benchmarks/precision.py --clock cpu):
# h32 x 64 (2 MFLOP) 1.05x (gen 1.09x, update 1.07x: no gain worth bf16's rounding), the demo's h128 x 352
# (46 MFLOP) 1.39x, the small h256 x 688 (180 MFLOP) 1.48x. (Before the engine decoded in bf16 and the
# recompute went, the demo's model was slower in bf16 and this stood at 100 MFLOP.)
AUTO_MIN_MLP_FLOPS = 1e7


def cpu_bf16_features(cpuinfo: str | Path | None = None) -> list[str]:
    """The bf16 matmul instruction sets this CPU has as scalerl sees it (`cpu_capabilities`: masked by
    ``SCALERL_CPU_ISA``); ``cpuinfo`` reads another /proc/cpuinfo (empty where it is absent)."""
    if cpuinfo is None:
        return list(cpu_capabilities().bf16_matmul)
    flags = mask_flags(read_cpuinfo(cpuinfo)[1], isa_level())
    return [f for f in CPU_BF16_FLAGS if f in flags]


def bf16_hardware(device: torch.device) -> str:
    """What multiplies in bf16 on ``device`` ("" where nothing does): the CPU's flags, or a CUDA device."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (bf16 tensor cores)" if torch.cuda.is_bf16_supported() else ""
    if device.type == "cpu":
        return ", ".join(cpu_bf16_features())
    return ""


def bf16_matmul_speedup(device: torch.device, rows: int, inner: int, outer: int, repeats: int = 5) -> float:
    """fp32 seconds over bf16 seconds of ``[rows, inner] @ [inner, outer]``; the bf16 side casts its fp32
    weight first, as autocast does once per pass. The two alternate and each keeps its best time, so other
    processes on a shared machine slow neither side more than the other."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=generator).to(device)
    weight = torch.randn(outer, inner, generator=generator).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    products = {"fp32": lambda: torch.nn.functional.linear(x, weight),
                "bf16": lambda: torch.nn.functional.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16))}
    best = dict.fromkeys(products, float("inf"))
    with torch.no_grad():
        for name, product in products.items():  # warm-up: kernel choice, allocations
            product()
        for _ in range(repeats):
            for name, product in products.items():
                start = time.perf_counter()
                product()
                sync()
                best[name] = min(best[name], time.perf_counter() - start)
    return best["fp32"] / best["bf16"]


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run computes in, why, and the measurement behind it (None where none was made)."""

    precision: str
    reason: str
    hardware: str = ""  # what multiplies in bf16 here ("" = nothing)
    bf16_over_fp32: float | None = None  # the probe's speed ratio on the model's MLP shape
    probe_shape: tuple[int, int, int] | None = None
    bf16_pays: bool | None = None  # whether auto's rule holds for this model here (None: not judged)
    requested: str = ""  # trainer.precision as configured ("auto" before it was resolved)
    slow: str = ""  # why the configured precision runs slower than fp32 here ("" where it does not)

    def health_context(self) -> dict:
        """The doctor's ``compute/precision`` inputs (`scalerl.health.compute_rules.unused_bf16`)."""
        out: dict = {"precision": self.precision, "bf16_hardware": self.hardware}
        if self.bf16_over_fp32 is not None:
            out["bf16_over_fp32"] = self.bf16_over_fp32
            out["bf16_probe_shape"] = list(self.probe_shape or ())
        if self.bf16_pays is not None:
            out["bf16_pays"] = self.bf16_pays
        return out


def choose_precision(requested: str, device: torch.device, model: ModelConfig, probe: bool = True,
                     agree: Callable[[float], float] | None = None,
                     recompute_under_bf16: str | None = None) -> PrecisionChoice:
    """`_choose_precision` for the whole step: on a CPU, ``auto`` keeps fp32 where a bf16 run would
    recompute the rollout's log-probs with fp32 generation (``recompute_under_bf16`` says why it would): the
    added pass costs about what bf16 saves on the update (0.5B-shaped, 4 layers: step 65.1 s bf16 against
    53.0 s fp32, the recompute 15.5 s; docs/performance.md, "bf16 against fp32")."""
    choice = replace(_choose_precision(requested, device, model, probe, agree), requested=requested)
    if not (recompute_under_bf16 and device.type == "cpu" and choice.bf16_pays):
        return choice
    # bf16 would not pay for the step: auto keeps fp32, and the doctor does not call an fp32 run's choice a waste.
    reason = (f"{choice.reason}, but {recompute_under_bf16}: bf16 would add an old-log-prob pass and generate in "
              "fp32, about what it saves on the update")
    return replace(choice, precision="fp32" if requested == "auto" else requested, bf16_pays=False,
                   reason=reason if requested == "auto" else choice.reason)


def _choose_precision(requested: str, device: torch.device, model: ModelConfig, probe: bool,
                      agree: Callable[[float], float] | None) -> PrecisionChoice:
    """``requested`` kept as it is unless it is ``auto``: then bf16 on a CUDA device with bf16, or on a CPU
    with bf16 instructions where the probe measures the model's matmuls at least `AUTO_MIN_SPEEDUP` faster
    in bf16 and that matmul is at least `AUTO_MIN_MLP_FLOPS`; fp32 otherwise. On a bf16-capable CPU the probe
    also runs for an fp32 run (``probe=False``
    skips it), so the doctor can say what fp32 leaves unused. ``agree`` turns this rank's measured ratio
    into the one every rank uses (the minimum over ranks), so that ranks never choose differently."""
    hardware = bf16_hardware(device)
    if device.type == "cuda" and hardware:
        ratio = device_peak_flops(device, torch.bfloat16) / device_peak_flops(device, torch.float32)
        if requested == "auto":
            return PrecisionChoice("bf16", f"{hardware}: bf16 peak {ratio:.1f}x fp32", hardware, ratio)
        return PrecisionChoice(requested, "as configured", hardware, ratio)
    if not hardware or not probe or requested not in ("auto", "fp32"):
        if device.type == "cpu" and probe and requested in ("auto", "fp32") and agree is not None:
            agree(0.0)  # join the agreement the ranks with bf16 hardware hold (mixed CPUs): none waits alone
        if requested != "auto":
            slow = cpu_capabilities().slow_precision_reason(requested) if device.type == "cpu" else ""
            if slow:  # it runs (autocast converts per call), but the user is told once, at start
                return PrecisionChoice(requested, f"as configured, but {slow}; trainer.precision=fp32 (or auto) "
                                       "is faster on this machine", hardware, slow=slow)
            return PrecisionChoice(requested, "as configured", hardware)
        return PrecisionChoice("fp32", f"no bf16 matmul hardware on this {device.type}", hardware)
    shape = (PROBE_ROWS, model.hidden_size, model.intermediate_size)
    speedup = bf16_matmul_speedup(device, *shape)
    if agree is not None:
        speedup = agree(speedup)
    measured = (f"bf16 ran this model's MLP matmul, [{shape[0]}x{shape[1]}] @ [{shape[1]}x{shape[2]}], at "
                f"{speedup:.2f}x fp32's speed here ({hardware})")
    flops = 2.0 * shape[0] * shape[1] * shape[2]
    too_small = flops < AUTO_MIN_MLP_FLOPS
    pays = speedup >= AUTO_MIN_SPEEDUP and not too_small
    if requested == "fp32":
        return PrecisionChoice("fp32", "as configured; " + measured, hardware, speedup, shape, pays)
    if pays:
        return PrecisionChoice("bf16", measured, hardware, speedup, shape, pays)
    if too_small:
        return PrecisionChoice("fp32", f"{measured}, but that matmul is {flops / 1e6:.0f} MFLOP, under the "
                               f"{AUTO_MIN_MLP_FLOPS / 1e6:.0f} MFLOP where the matmuls rather than per-op overhead "
                               "set the step", hardware, speedup, shape, pays)
    return PrecisionChoice("fp32", f"{measured}, under the {AUTO_MIN_SPEEDUP}x that pays for autocast's "
                           "casts and the ops that stay fp32", hardware, speedup, shape, pays)
