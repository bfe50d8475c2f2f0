"""Cluster rules on what each rank computes with, from the distributed check's facts: the precision the
config asks for (``trainer.precision``, ``rollout.dtype``) against each CPU rank's instruction sets and each
GPU rank's compute capability, and hardware that differs across the ranks of one job.

A rank's ``cpu`` fact is `scalerl.core.cpu_capabilities.CpuCapabilities.as_dict()` (after ``SCALERL_CPU_ISA``,
so a capped rank reads as the CPU it is told to be); its ``gpus`` entries carry ``capability`` ("8.0") and
``bf16``. Facts without them (reports of older scalerl versions) leave these rules unmeasured.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Any

from scalerl.core.cpu_capabilities import (
    BF16_MATMUL_FLAGS,
    FP16_MATMUL_FLAGS,
    ISA_SWITCH,
    CpuCapabilities,
)
from scalerl.health.node_rules import node_names
from scalerl.health.thresholds import RULES
from scalerl.health.tree import NOT_MEASURED, OK, Finding
from scalerl.health.wording import finding, ranges

# The measurement behind the CPU fix (the 2-core AVX2 AMD EPYC this project is developed on, torch 2.13).
SLOW_BF16_MEASURED = ("measured on an AVX2-only AMD EPYC: a bf16 [512x256] @ [256x688] matmul at ~0.1x fp32's "
                      "speed, [16x896] @ [896x4864] at ~0.3x")
# torch's dispatch levels on x86, lowest first (`torch.backends.cpu.get_cpu_capability()`); ATEN_CPU_CAPABILITY
# takes them in lower case.
ATEN_LEVELS = ("DEFAULT", "AVX2", "AVX512")
GPU_BF16_FIX = "or run on GPUs of compute capability 8.0 or newer (A100, H100, L4, RTX 30xx and later)"


def precision_settings(cfg: Any) -> dict[str, str]:
    """What the hardware rules read from a run's config: the precisions it asks for and where it decodes."""
    return {"trainer.precision": cfg.trainer.precision, "rollout.dtype": cfg.rollout.dtype,
            "rollout.engine": cfg.rollout.engine, "rollout.placement": cfg.rollout.placement}


def cpu_of(fact: dict[str, Any]) -> CpuCapabilities | None:
    """The rank's CPU as `CpuCapabilities` (its methods word the findings); None where it did not report one."""
    cpu = fact.get("cpu") or {}
    known = {f.name for f in dataclasses.fields(CpuCapabilities)}
    try:
        return CpuCapabilities(**{k: tuple(v) if isinstance(v, list) else v for k, v in cpu.items() if k in known})
    except TypeError:  # no cpu fact, or one without a field
        return None


def own_gpu(fact: dict[str, Any]) -> dict[str, Any] | None:
    gpus = fact.get("gpus") or []
    return gpus[fact.get("local_rank", 0) % len(gpus)] if fact.get("device") == "cuda" and gpus else None


def cpu_text(cpu: CpuCapabilities) -> str:
    """"AMD EPYC (avx2 fma f16c; torch dispatch AVX2)": what sets a CPU rank's kernels (the flags are those
    left by ``SCALERL_CPU_ISA``, so a rank capped to another's level reads as that one)."""
    return f"{cpu.model or cpu.machine} ({' '.join(cpu.flags) or 'no vector flags'}; torch dispatch {cpu.aten})"


def _asked(settings: dict[str, str]) -> list[tuple[str, str]]:
    """(config key, precision) of every setting that asks for bf16 or fp16 (``auto`` chooses per machine)."""
    asked = [("trainer.precision", settings.get("trainer.precision", "fp32"))]
    # rollout.dtype applies to standalone workers and to vLLM (the config refuses it elsewhere).
    if settings.get("rollout.placement") == "standalone" or settings.get("rollout.engine") == "vllm":
        asked.append(("rollout.dtype", settings.get("rollout.dtype", "fp32")))
    return [(key, value) for key, value in asked if value in ("bf16", "fp16")]


def _decode_dtype(settings: dict[str, str]) -> tuple[str, str] | None:
    """(config key, dtype) the built-in engine decodes in, where that is bf16 or fp16: the trainer's precision
    when colocated, rollout.dtype on standalone workers; None for vLLM (its own kernels)."""
    if settings.get("rollout.engine") == "vllm":
        return None
    key = "rollout.dtype" if settings.get("rollout.placement") == "standalone" else "trainer.precision"
    value = settings.get(key, "fp32")
    return (key, value) if value in ("bf16", "fp16") else None


def _cpu_fix(key: str, precision: str, every_rank: bool) -> str:
    # auto only where no rank has the instructions: on mixed CPUs it would decide on each rank's own.
    cheaper = f"{key}=fp32 (or {key}=auto: it probes at start and keeps fp32 here)" \
        if key == "trainer.precision" and every_rank else f"{key}=fp32"
    flags = BF16_MATMUL_FLAGS if precision == "bf16" else FP16_MATMUL_FLAGS
    return (f"{cheaper}: fp32 is faster on a CPU without {precision} matmul instructions ({SLOW_BF16_MEASURED}); "
            f"or run on CPUs with {' or '.join(flags)}")


def cpu_precision(facts: list[dict[str, Any]], settings: dict[str, str]) -> list[Finding]:
    """bf16/fp16 asked of CPU ranks without the matmul instructions for it (a warning: it runs, slower than
    fp32), a ``SCALERL_CPU_ISA`` naming no level (a fault), and where the built-in engine decodes over plain
    weights because oneDNN's blocked layout does not run (ok: correct, only not the fastest path)."""
    rule = RULES["cpu_precision"]
    names = node_names(facts)
    ranks = [f for f in facts if f.get("device", "cpu") == "cpu"]
    out = []
    broken = [f for f in ranks if (f.get("cpu") or {}).get("error")]
    for f in broken:
        out.append(finding("cpu_precision", rule.severities["isa_switch"].status, f"rank {f['rank']} on "
                            f"{names[f['node_id']]}: {f['cpu']['error']}", {"rank": f["rank"], "error": f["cpu"]["error"]},
                            f"export {ISA_SWITCH}=native (or avx2, default), or unset it, on "
                            f"{names[f['node_id']]}", ranks=[f["rank"]], hosts=[names[f["node_id"]]]))
    cpus = {f["rank"]: cpu for f in ranks if (cpu := cpu_of(f)) is not None}
    if not cpus:
        return out or ([finding("cpu_precision", NOT_MEASURED, "no CPU rank reported its instruction sets")]
                       if ranks else [])
    by_rank = {f["rank"]: f for f in ranks}
    for key, precision in _asked(settings):
        slow: dict[str, list[int]] = defaultdict(list)  # one finding per kind of CPU, worded by it
        fast: dict[str, list[int]] = defaultdict(list)
        for rank, cpu in cpus.items():
            reason = cpu.slow_precision_reason(precision)
            (slow[reason] if reason else fast[cpu.matmul_hardware(precision)]).append(rank)
        for hardware, fast_ranks in fast.items():
            out.append(finding("cpu_precision", OK, f"{key}={precision}: rank(s) {ranges(fast_ranks)} multiply in "
                                f"{precision} ({hardware})"))
        for reason, slow_ranks in slow.items():
            cpu = cpus[slow_ranks[0]]
            hosts = [names[by_rank[r]["node_id"]] for r in slow_ranks]
            lacks = BF16_MATMUL_FLAGS if precision == "bf16" else FP16_MATMUL_FLAGS
            evidence = {"setting": key, "precision": precision, "ranks": slow_ranks, "cpu_model": cpu.model,
                        "lacks": list(lacks), "flags": list(cpu.flags), "torch_dispatch": cpu.aten,
                        "isa_level": cpu.level}
            out.append(finding("cpu_precision", rule.severities["no_matmul"].status,
                                f"{key}={precision} on rank(s) {ranges(slow_ranks)} ({', '.join(dict.fromkeys(hosts))}): "
                                f"{reason}", evidence, _cpu_fix(key, precision, not fast), ranks=slow_ranks, hosts=hosts))
    decode = _decode_dtype(settings)
    if decode is not None:
        key, dtype = decode
        plain = {r: cpu.onednn_linear.get(dtype, "") for r, cpu in cpus.items()}
        plain = {r: why for r, why in plain.items() if why and why != "not probed"}
        if plain:
            rank = min(plain)
            out.append(finding("cpu_precision", OK, f"{key}={dtype}: the built-in engine decodes over plain {dtype} "
                                f"weights on rank(s) {ranges(sorted(plain))}, as oneDNN's blocked layout does not run "
                                f"there ({plain[rank]}); correct, without the blocked layout's speed-up",
                                {"setting": key, "dtype": dtype, "plain_layout": {str(r): w for r, w in plain.items()}}))
    if not out:
        asked = ", ".join(f"{k}={settings[k]}" for k in ("trainer.precision", "rollout.dtype") if k in settings)
        auto = " (auto probes at start and keeps fp32 where bf16 does not pay)" if "=auto" in asked else ""
        out.append(finding("cpu_precision", OK, f"{asked or 'no precision given'}: no bf16 or fp16 matmul asked of "
                            f"the CPU{auto}", {"settings": settings}))
    return out


def gpu_precision(facts: list[dict[str, Any]], settings: dict[str, str]) -> list[Finding]:
    """bf16 asked of GPU ranks whose GPU has no bf16 support (compute capability below 8.0): a fault."""
    rule = RULES["gpu_precision"]
    names = node_names(facts)
    gpus = {f["rank"]: (f, gpu) for f in facts if (gpu := own_gpu(f)) is not None and "bf16" in gpu}
    if not gpus:
        return []
    out = []
    for key, precision in _asked(settings):
        if precision != "bf16":
            continue
        lacking = {r: fg for r, fg in gpus.items() if not fg[1]["bf16"]}
        if not lacking:
            out.append(finding("gpu_precision", OK, f"{key}=bf16: every GPU rank's device supports bf16 (compute "
                                f"capability {', '.join(sorted({g['capability'] for _, g in gpus.values()}))})"))
            continue
        devices = sorted({f"{g['name']} (compute capability {g['capability']})" for _, g in lacking.values()})
        hosts = [names[f["node_id"]] for f, _ in lacking.values()]
        alternatives = f"{key}=fp16 (with its grad scaler) or {key}=fp32" if key == "trainer.precision" \
            else f"{key}=fp32"
        out.append(finding("gpu_precision", rule.severities["no_bf16"].status,
                            f"{key}=bf16 on rank(s) {ranges(sorted(lacking))} ({', '.join(dict.fromkeys(hosts))}): "
                            f"{', '.join(devices)} has no bf16 support (it needs compute capability 8.0 or newer)",
                            {"setting": key, "ranks": sorted(lacking),
                             "gpus": {str(r): {"name": g["name"], "capability": g["capability"]}
                                      for r, (_, g) in lacking.items()}},
                            f"{alternatives}, {GPU_BF16_FIX}", ranks=list(lacking), hosts=hosts))
    return out


def mixed_hardware(facts: list[dict[str, Any]]) -> list[Finding]:
    """Ranks of one job on different CPUs (model, instruction sets, dispatch level) or on GPUs of different
    compute capabilities: one finding per kind of device, naming the ranks off the most common hardware."""
    out = []
    cpus = {f["rank"]: cpu for f in facts if f.get("device", "cpu") == "cpu" and (cpu := cpu_of(f)) is not None}
    if cpus:
        out.append(_mixed(facts, "cpu", {r: cpu_text(c) for r, c in cpus.items()}, _cpu_pin(list(cpus.values()))))
    gpus = {f["rank"]: gpu for f in facts if (gpu := own_gpu(f)) is not None and "capability" in gpu}
    if gpus:
        kinds = {r: f"compute capability {g['capability']} ({g['name']})" for r, g in gpus.items()}
        pin = "bf16" if all(g.get("bf16") for g in gpus.values()) else "fp32"
        out.append(_mixed(facts, "gpu", kinds, f"trainer.precision={pin} explicitly (auto chooses per device)",
                          pool="one GPU type (Slurm --gres=gpu:<type>:N or --constraint; Ray accelerator_type; a "
                               "Kubernetes nodeSelector on the GPU product)"))
    return out or [finding("mixed_hardware", NOT_MEASURED, "no rank reported its CPU or GPU capabilities")]


def _mixed(facts: list[dict[str, Any]], kind: str, hardware: dict[int, str], pin: str,
           pool: str = "one kind of node (Slurm --constraint=<feature>; a Kubernetes nodeSelector or node affinity "
                       "on the CPU model; a Ray custom resource per node type)") -> Finding:
    kinds = Counter(hardware.values())
    if len(kinds) < 2:
        return finding("mixed_hardware", OK, f"every {kind.upper()} rank runs on {next(iter(kinds))}",
                       {"hardware": next(iter(kinds)), "ranks": sorted(hardware)})
    names = node_names(facts)
    node = {f["rank"]: names[f["node_id"]] for f in facts}
    majority = kinds.most_common(1)[0][0]
    odd = sorted(r for r, h in hardware.items() if h != majority)
    by_kind = {h: sorted(r for r in hardware if hardware[r] == h) for h in kinds}
    return finding("mixed_hardware", RULES["mixed_hardware"].severities[kind].status,
                   f"{kind.upper()}s differ across ranks: " + "; ".join(
                       f"{h} on rank(s) {ranges(rs)} ({', '.join(dict.fromkeys(node[r] for r in rs))})"
                       for h, rs in by_kind.items()),
                   {"hardware": by_kind}, f"run the job on {pool}; or pin {pin}, so every rank takes the same path",
                   ranks=odd, hosts=[node[r] for r in odd])


def _cpu_pin(cpus: list[CpuCapabilities]) -> str:
    """The settings that put every rank on the path the least capable CPU takes."""
    precision = "bf16" if all(c.bf16_matmul for c in cpus) else "fp32"
    switches = []
    if len({c.flags for c in cpus}) > 1:
        switches.append(f"{ISA_SWITCH}={'avx2' if all('avx2' in c.flags for c in cpus) else 'default'}")
    atens = {c.aten for c in cpus}
    if len(atens) > 1 and atens <= set(ATEN_LEVELS):
        switches.append(f"ATEN_CPU_CAPABILITY={min(atens, key=ATEN_LEVELS.index).lower()}")
    # Not auto: it decides on each rank's own instructions, so mixed CPUs would not reach it by one path.
    pin = f"trainer.precision={precision} explicitly (not auto)"
    return pin + (f" and export {' '.join(switches)} on every rank" if switches else "")


def run_hardware_rules(facts: list[dict[str, Any]], settings: dict[str, str] | None) -> list[Finding]:
    """Every hardware rule; the precision rules only where a config was given (``settings``)."""
    findings = mixed_hardware(facts)
    if settings is not None:
        findings += cpu_precision(facts, settings) + gpu_precision(facts, settings)
    return findings

