"""One rank's part of `scalerl doctor`: the same function runs on every rank of a world started by any
launcher (torchrun, Slurm, MPI, Ray rank actors, or one plain process). It collects this rank's facts,
joins the others (naming any that never come), runs the checks the options ask for, and on the main rank
turns everything into a report on the tree. Every rank returns the same exit code."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scalerl.core.config import Config, load_config
from scalerl.core.device import resolve_device
from scalerl.core.rank_env import detect_rank_env
from scalerl.doctor.bandwidth import MiB, measure_bandwidth, sweep_sizes
from scalerl.doctor.facts import collect_rank_facts
from scalerl.doctor.plan_comparison import compare_plan, read_plan
from scalerl.doctor.profiling import (
    checkpoint_context,
    mean_metrics,
    profile_rank,
    profile_waterfall,
)
from scalerl.doctor.report import DoctorReport
from scalerl.doctor.storage import check_paths
from scalerl.doctor.transfer import measure_host_device_copy
from scalerl.doctor.world import (
    DoctorWorld,
    RendezvousError,
    existing_world,
    join_world,
    single_world,
)
from scalerl.health.cluster_rules import run_cluster_rules
from scalerl.health.hardware_rules import precision_settings
from scalerl.health.node_rules import node_names, nodes
from scalerl.health.step_rules import StepView, run_step_rules
from scalerl.health.tree import NOT_MEASURED, Finding


@dataclass
class DoctorOptions:
    distributed_check: bool = True
    profile: bool = False
    config_path: str | None = None
    overrides: list[str] = field(default_factory=list)
    kind: str = "rl"  # which trainer --performance-profiling runs: rl | sft
    steps: int = 3
    warmup: int = 1
    trace_dir: str | None = None
    min_size: int = MiB
    max_size: int | None = None  # None: 256 MiB with CUDA, 16 MiB on the CPU
    iters: int = 5
    join_timeout_s: float = 60.0
    timeout_s: float = 300.0
    paths: list[str] = field(default_factory=list)
    scratch_dir: str = "outputs/doctor"
    device: str = "auto"
    plan_path: str | None = None  # a `scalerl plan --json` file: planned vs measured per phase, when profiled

    def largest(self, device: torch.device) -> int:
        return self.max_size or (256 * MiB if device.type == "cuda" else 16 * MiB)

    @property
    def modes(self) -> list[str]:
        return [m for m, on in (("distributed-check", self.distributed_check),
                                ("performance-profiling", self.profile)) if on]


def _config(options: DoctorOptions) -> Config:
    return load_config(options.config_path, options.overrides)


def _paths(cfg: Config, options: DoctorOptions) -> list[tuple[str, str]]:
    out = Path(cfg.trainer.output_dir)
    return [("output", str(out)), ("checkpoint", str(out / "checkpoints"))] + [("path", p) for p in options.paths]


def _repair_socket_variable(facts: dict[str, Any], environ: Mapping[str, str]) -> None:
    """A *_SOCKET_IFNAME naming an absent interface would stop the doctor's own group: use the interface
    scalerl would pick instead, so the check runs and reports the variable as the fault it is."""
    s = facts["socket"]
    if s.get("missing") and environ is os.environ:
        if s.get("suggestion"):
            os.environ[s["variable"]] = s["suggestion"]
        else:
            os.environ.pop(s["variable"], None)


def _join(env, facts: dict[str, Any], options: DoctorOptions, backend: str) -> DoctorWorld:
    if dist.is_available() and dist.is_initialized():
        return existing_world(facts)
    if env is None or env.world_size == 1:
        return single_world(facts)
    return join_world(env, facts, options.join_timeout_s, options.timeout_s, backend)


def diagnose(options: DoctorOptions, environ: Mapping[str, str] | None = None,
             on_report: Callable[[DoctorReport], None] | None = None) -> tuple[int, DoctorReport | None]:
    """Run the doctor on this rank; (exit code, the report on the main rank or a rank left alone, else None).
    ``on_report`` (printing, writing the JSON) runs on the main rank before any rank returns: launchers
    kill the remaining ranks as soon as one exits with an error, which a fault's exit code is."""
    environ = os.environ if environ is None else environ
    env = detect_rank_env(environ)
    device = resolve_device(options.device)
    cfg = _config(options)
    facts = collect_rank_facts(env, _paths(cfg, options), device, environ)
    _repair_socket_variable(facts, environ)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and env is not None:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    created_group = not (dist.is_available() and dist.is_initialized())
    try:
        world = _join(env, facts, options, backend)
    except RendezvousError as e:  # alone: report what this rank knows
        joined = {"missing": [], "why": str(e)}
        failed = Finding("communication/topology", "rendezvous", "fault", str(e), {"rank": facts["rank"]},
                         "start rank 0 first (it hosts the rendezvous) and check MASTER_ADDR / MASTER_PORT: "
                         f"{facts['master']}", (facts["rank"],))
        alone = run_cluster_rules([facts], {}, precision_settings(cfg)) + [failed]
        report = DoctorReport(options.modes, alone, [facts], {}, {
            "world_size": facts["world_size"], "joined": [facts["rank"]], "missing": [], "launcher": facts["launcher"],
            "nodes": {facts["hostname"]: [facts["rank"]]}, **joined})
        if on_report is not None:
            on_report(report)
        return report.exit_code, report
    try:
        return _run_checks(world, cfg, options, device, backend, on_report)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _run_checks(world: DoctorWorld, cfg: Config, options: DoctorOptions, device: torch.device, backend: str,
                on_report: Callable[[DoctorReport], None] | None) -> tuple[int, DoctorReport | None]:
    measured: dict[str, Any] = {"rendezvous": {"world_size": world.world_size, "joined": world.joined,
                                               "missing": world.missing, "join_timeout_s": world.join_timeout_s,
                                               "master": world.master}}
    timeout = options.timeout_s
    facts = [dict(f) for f in world.facts]
    if options.distributed_check:
        largest = options.largest(device)
        if world.size > 1:
            measured["bandwidth"] = measure_bandwidth(world, sweep_sizes(options.min_size, largest), options.iters,
                                                      device, backend, timeout)
        else:
            measured["bandwidth"] = {"why": "one rank: no all-reduce to measure"}
        measured["shared"] = check_paths(world, _paths(cfg, options), max(4 * MiB, min(largest, 256 * MiB)), timeout)
        copies = world.all_gather_json("copies", measure_host_device_copy(device, largest), timeout)
        for f, c in zip(facts, copies):
            f["copy"] = c
        _merge_write_speeds(facts, measured["shared"])
    step_findings: list[Finding] = []
    if options.profile:
        step_findings, measured["profile"] = _profile(world, cfg, options, device)
    code, report = 0, None
    if world.is_main:
        # Rules on the facts (versions, interfaces, placement, devices) run in every mode: the facts come
        # with joining; bandwidth and shared paths only when the distributed check measured them.
        cluster = run_cluster_rules(facts, {k: v for k, v in measured.items() if k != "profile"},
                                    precision_settings(cfg))
        report = DoctorReport(options.modes, cluster + step_findings, facts, measured, {
            "world_size": world.world_size, "joined": world.joined, "missing": world.missing,
            "nodes": nodes(facts), "launcher": facts[0].get("launcher", "single")})
        code = report.exit_code
        if on_report is not None:
            on_report(report)
    code = world.broadcast_json("exit", code, timeout)
    world.finish(timeout)
    return code, report


def _merge_write_speeds(facts: list[dict[str, Any]], shared: dict[str, Any]) -> None:
    names = node_names(facts)
    for f in facts:
        for p in f.get("paths", []):
            speed = shared.get("write", {}).get(names[f["node_id"]], {}).get(p["path"])
            if speed:
                p["write_bytes_per_s"] = speed


def _profile(world: DoctorWorld, cfg: Config, options: DoctorOptions,
             device: torch.device) -> tuple[list[Finding], dict[str, Any]]:
    if world.missing:
        why = f"profiling needs every rank; {len(world.missing)} did not join"
        return [Finding("compute/stragglers", "profile", NOT_MEASURED, why)], {"why": why}
    largest = options.largest(device)
    result = profile_rank(world, cfg, options.kind, options.steps, options.warmup, Path(options.scratch_dir),
                          options.trace_dir, min(largest, 16 * MiB))
    records = world.all_gather_json("profile", result["record"], options.timeout_s)
    if not world.is_main:
        return [], {}
    context = dict(result["context"])
    context.update(checkpoint_context(cfg, records, len(nodes(world.facts)), context.get("dp_replicate", 1),
                                      min(largest, 256 * MiB), options.kind))
    metrics = mean_metrics(result["reduced"])
    # DDP's gradient buckets run below Python: comm accounting's exposed wait for them, added to the time
    # the doctor saw in collectives itself.
    context["comm_wait_s"] = sum(r["comm_s"] for r in records) / len(records) + metrics.get("timing_s/comm/grad", 0.0)
    view = StepView(metrics, records, context)
    findings = run_step_rules(view, reward_history=result["reduced"], mismatch_history=result["reduced"])
    profile = {"per_rank": records, "metrics": metrics, "context": context, "steps": options.steps,
               "warmup": options.warmup, "kind": options.kind, "trace_dir": options.trace_dir}
    profile["mfu_waterfall"] = profile_waterfall(cfg, options.kind, records, metrics, context)
    if options.plan_path:
        profile["plan"] = compare_plan(read_plan(options.plan_path), records, options.plan_path)
    return findings, profile
