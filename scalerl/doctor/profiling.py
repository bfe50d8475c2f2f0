"""`--performance-profiling CONFIG`: N steps of a real config on every rank, with a `PhaseProfiler` as the
trainer's step timer and collectives timed (`CollectiveWaits`), so each rank's time splits into
its own work, waiting for peers and communication, per phase. Optionally a `torch.profiler` Chrome trace
per rank; on a GPU the profiler also gives host<->device copy time.

Around the steps each rank also measures what the run does once or every few steps: its host RAM peak
(VmHWM) while the model loads, while a checkpoint is saved and while the model is exported, and the
seconds of that save, with the run's own `save` and `export` (the host-RAM and checkpoint-cost leaves).

The run writes only under the doctor's scratch directory (trainer.output_dir is redirected there, with no
metric sinks and no resume), so a profile never touches the run's own outputs or checkpoints.
"""

from __future__ import annotations

import copy
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from scalerl.core.config import Config, ConfigError
from scalerl.core.device import compute_dtype
from scalerl.doctor.bandwidth import MiB, all_reduce_sweep
from scalerl.doctor.collective_waits import CollectiveWaits
from scalerl.doctor.host_memory import host_peak_gb, node_memory_gb, reset_host_peak
from scalerl.doctor.phase_profiler import (
    PhaseProfiler,
    PhaseStats,
    TimedOptimizerStep,
    current_memory_gb,
)
from scalerl.doctor.storage import probe_dir, write_speed
from scalerl.doctor.world import DoctorWorld
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.perf.flops import device_peak_flops, matmul_param_count
from scalerl.perf.memory import memory_capacity_gb
from scalerl.perf.mfu_waterfall import (
    HOST_PHASES,
    UPDATE_PHASES,
    CollectiveWaitSplit,
    step_waterfall,
)


def profile_config(cfg: Config, scratch: Path, steps: int, warmup: int) -> Config:
    """The config the profile runs: the user's, writing under ``scratch``, for warmup + steps steps."""
    if getattr(cfg.rollout, "placement", "colocated") == "standalone":
        raise ConfigError("--performance-profiling runs colocated rollouts only so far; profile the layout with "
                          "rollout.placement=colocated (standalone workers' ranks serve generation, not steps)")
    cfg = copy.deepcopy(cfg)
    cfg.trainer.output_dir = str(scratch / "profile")
    cfg.sft.output_dir = str(scratch / "profile" / "sft")
    cfg.trainer.logger, cfg.trainer.resume, cfg.trainer.monitor_every = [], "never", 0
    cfg.trainer.overwrite = True  # the scratch is the doctor's: the last profile's checkpoint and export go
    cfg.trainer.total_steps = max(cfg.trainer.total_steps, warmup + steps)
    cfg.sft.steps = max(cfg.sft.steps, warmup + steps)
    return cfg  # validated by the run's entry (`start_run`)


def _trainer_class(kind: str):
    if kind == "sft":
        from scalerl.trainer.sft_trainer import SFTTrainer

        return SFTTrainer
    from scalerl.trainer.rl_trainer import RLTrainer

    return RLTrainer


def _state_bytes(trainer) -> int:
    tensors = list(trainer.state_module().parameters())
    tensors += [t for state in trainer.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _copy_seconds(prof) -> float:
    """Device time in host<->device copies recorded by torch.profiler."""
    total_us = 0.0
    for event in prof.key_averages():
        if "Memcpy HtoD" in event.key or "Memcpy DtoH" in event.key:
            total_us += getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0))
    return total_us / 1e6


def profile_rank(world: DoctorWorld, user_cfg: Config, kind: str, steps: int, warmup: int, scratch: Path,
                 trace_dir: str | None, link_size: int) -> dict[str, Any]:
    """Run the profile on this rank; returns its record (per-step means) plus the step metrics reduced over
    ranks (the same on every rank) under ``reduced``."""
    from scalerl.core.device import resolve_device
    from scalerl.trainer.run import start_run

    cfg = profile_config(user_cfg, scratch, steps, warmup)
    trainer_class = _trainer_class(kind)
    ctx = start_run(cfg, trainer_class.kind)
    device = resolve_device(cfg.trainer.device)
    waits = CollectiveWaits()
    timer = PhaseProfiler(device, waits, distributed=ctx.world_size > 1)
    host_ram: dict[str, float] = {}
    baseline_gb = current_memory_gb(device)  # the process before the model: interpreter, libraries
    with _host_peak(host_ram, "load") as load:
        trainer = trainer_class(cfg, ctx, timer=timer, wrap_optimizer_step=lambda step: TimedOptimizerStep(step, timer))
    link_busbw = None
    if ctx.world_size > 1:
        sweep = all_reduce_sweep(None, ctx.world_size, [link_size], 3, device)
        link_busbw = sweep[0]["busbw"]
    per_step: list[dict[str, Any]] = []
    reduced: list[dict[str, float]] = []
    copy_s = None
    with waits:
        for _ in range(warmup):
            reduce_metrics(trainer.advance(reduced=False), ctx)
        profiler = _profiler(device, trace_dir)
        with profiler if profiler is not None else _nothing():
            for _ in range(steps):
                timer.take_step()
                local = trainer.advance(reduced=False)
                phases = timer.take_step()
                per_step.append(_step_record(local, phases))
                reduced.append(reduce_metrics(local, ctx))
        if profiler is not None:
            if trace_dir:
                Path(trace_dir).mkdir(parents=True, exist_ok=True)
                profiler.export_chrome_trace(str(Path(trace_dir) / f"rank{world.rank}.json"))
            if device.type == "cuda":
                copy_s = _copy_seconds(profiler) / steps
    eval_s = None
    if getattr(trainer, "val_rows", None):  # one evaluation, as the run's loop calls it (the waterfall's slice)
        start = time.perf_counter()
        trainer.evaluate()
        eval_s = time.perf_counter() - start
    # The run's own save and export, as its loop calls them (every rank takes part), into the scratch directory.
    with _host_peak(host_ram, "checkpoint") as save:
        trainer.save()
    with _host_peak(host_ram, "export") as export:
        trainer.export()
    node = node_memory_gb()
    local_ranks = int(world.facts[0].get("local_world_size", 1))
    record = _mean_record(per_step)
    record.update(rank=world.rank, host=next(f["hostname"] for f in world.facts if f["rank"] == world.rank),
                  # A CPU's memory is the node's, shared by its ranks; a GPU's is its rank's own.
                  capacity_gb=node["total_gb"] / local_ranks if device.type == "cpu" else memory_capacity_gb(device),
                  state_bytes=_state_bytes(trainer), host_ram=host_ram, node_memory_gb=node["total_gb"],
                  node_memory_source=node["source"], baseline_gb=baseline_gb, load_s=load["s"], save_s=save["s"],
                  export_s=export["s"], host_peak_reset=load["reset"] and save["reset"] and export["reset"])
    if copy_s is not None:
        record["copy_s"] = copy_s
    if eval_s is not None:
        record["eval_s"] = eval_s
    context = _context(cfg, trainer, link_busbw)
    trainer.logger.close()
    return {"record": record, "reduced": reduced, "context": context}


class _host_peak:
    """Times a block and records this process's host RAM peak in it under ``peaks[name]`` (GiB); yields a
    dict that gets ``s`` (seconds) and ``reset`` (whether the peak could be reset at its start)."""

    def __init__(self, peaks: dict[str, float], name: str):
        self.peaks, self.name, self.out = peaks, name, {}

    def __enter__(self) -> dict[str, Any]:
        self.out["reset"] = reset_host_peak()
        self._start = time.perf_counter()
        return self.out

    def __exit__(self, *exc):
        self.out["s"] = time.perf_counter() - self._start
        self.peaks[self.name] = host_peak_gb()
        return False


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _profiler(device: torch.device, trace_dir: str | None):
    if trace_dir is None and device.type != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _step_record(local: dict[str, float], phases: dict[str, PhaseStats]) -> dict[str, Any]:
    step_s = local["timing_s/step"]
    named = {k: v for k, v in phases.items() if k != "other"}
    other = phases.get("other", PhaseStats())
    other.time_s = max(0.0, step_s - sum(p.time_s for p in named.values()))  # untimed parts of the step
    phases = {**named, "other": other}
    return {
        "step_s": step_s,
        "peer_s": sum(p.peer_s for p in phases.values()),
        "comm_s": sum(p.comm_s for p in phases.values()),
        "update_tokens": local.get("perf/update_tokens"),
        "phases": {k: {"time_s": p.time_s, "busy_s": p.busy_s, "wait_s": p.peer_s + p.comm_s, "peer_s": p.peer_s,
                       "comm_s": p.comm_s, "peak_gb": p.peak_gb, "start_gb": p.start_gb} for k, p in phases.items()},
    }


def _mean_record(steps: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    record = {k: mean(s[k] for s in steps) for k in ("step_s", "peer_s", "comm_s", "update_tokens")}
    if record["update_tokens"] is None:
        del record["update_tokens"]
    record["busy_by_step"] = [max(0.0, s["step_s"] - s["peer_s"] - s["comm_s"]) for s in steps]
    record["wait_s"] = record["peer_s"] + record["comm_s"]
    record["busy_s"] = max(0.0, record["step_s"] - record["wait_s"])
    names = list(dict.fromkeys(name for s in steps for name in s["phases"]))
    record["phases"] = {}
    for name in names:
        rows = [s["phases"][name] for s in steps if name in s["phases"]]
        stats = {k: sum(r[k] for r in rows) / len(steps) for k in ("time_s", "busy_s", "wait_s", "peer_s", "comm_s")}
        stats["peak_gb"] = max(r["peak_gb"] for r in rows)
        stats["start_gb"] = max(r["start_gb"] for r in rows)
        record["phases"][name] = stats
    return record


def _context(cfg: Config, trainer, link_busbw: float | None) -> dict[str, Any]:
    dims, mc = trainer.dist.dims, trainer.model_config
    dtype = compute_dtype(trainer.cfg.trainer.precision, getattr(torch, cfg.model.dtype))  # auto resolved
    context = {
        "device": trainer.device.type, "world_size": dims.world_size, "dp_size": dims.dp, "tp": dims.tp,
        "pp": dims.pp, "dp_replicate": dims.dp_replicate, "microbatches": cfg.parallel.microbatches,
        "pp_schedule": cfg.parallel.pp_schedule, "balance_batch": cfg.trainer.balance_batch,
        "hidden_size": mc.hidden_size, "dtype_bytes": dtype.itemsize,
        "layer_params": (matmul_param_count(mc) - mc.hidden_size * mc.vocab_size) / mc.num_hidden_layers,
    }
    context.update(trainer.precision_choice.health_context())  # compute/precision: the bf16 probe
    if link_busbw:
        context["link_busbw"] = link_busbw
    if dims.tp > 1:
        context["peak_flops"] = device_peak_flops(trainer.device, dtype)
    return context


def checkpoint_context(user_cfg: Config, records: list[dict[str, Any]], nodes: int, dp_replicate: int,
                       write_bytes: int, kind: str = "rl") -> dict[str, Any]:
    """The checkpoint rules' inputs, on the main rank: an estimate of the bytes each node writes (the
    ranks' state divided by its replicas, spread over the nodes), the write speed at the checkpoint path,
    and the measured save (the slowest rank's seconds) with the steps it is spread over."""
    checkpoint_path = Path(user_cfg.trainer.output_dir) / "checkpoints"
    directory = probe_dir(str(checkpoint_path))
    per_node = sum(r["state_bytes"] for r in records) / max(1, dp_replicate) / max(1, nodes)
    context: dict[str, Any] = {"checkpoint_bytes": per_node, "save_every": user_cfg.trainer.save_every,
                               "keep_last": user_cfg.trainer.keep_last, "checkpoint_path": str(checkpoint_path),
                               "total_steps": user_cfg.sft.steps if kind == "sft" else user_cfg.trainer.total_steps}
    saves = [r["save_s"] for r in records if "save_s" in r]
    if saves:  # the save ends when its slowest rank's part is written (a distributed save publishes after all)
        context["save_s"] = max(saves)
    try:
        context["write_bytes_per_s"] = write_speed(directory, max(MiB, min(write_bytes, int(per_node))))
        context["free_bytes"] = shutil.disk_usage(directory).free
    except OSError:
        pass
    return context


def mean_metrics(reduced: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*reduced) if reduced else set()
    return {k: statistics.mean(r[k] for r in reduced if k in r) for k in keys}



def measured_waits(records: list[dict[str, Any]], metrics: dict[str, float]) -> CollectiveWaitSplit:
    """The ranks' time in collectives as the profile measured it (`CollectiveWaits`: a barrier before each
    collective splits waiting for the slowest rank from the collective itself), mean over ranks, per step;
    the weight sync's phase left to its own slice and the untimed remainder ("other", where the step's
    metrics are reduced, outside the step) left out. DDP's gradient buckets run below Python: comm
    accounting's ``timing_s/comm/grad`` (its least over ranks the transfer) is added for them."""
    n = max(1, len(records))

    def mean(names, key: str) -> float:
        return sum(p[key] for r in records for name, p in r["phases"].items() if names(name)) / n

    def timed(name: str) -> bool:
        return name not in ("update_weights", "other")

    def in_update(name: str) -> bool:
        return name in (*UPDATE_PHASES, "optimizer")  # the optimizer step nests in an update

    grad = metrics.get("timing_s/comm/grad", 0.0)
    least = min(grad, metrics.get("timing_s/comm/grad/min", grad))
    return CollectiveWaitSplit(
        transfer_s=mean(timed, "comm_s") + least, peers_s=mean(timed, "peer_s") + grad - least,
        update_s=mean(in_update, "comm_s") + mean(in_update, "peer_s") + grad,
        gen_s=mean(lambda name: name == "gen", "comm_s") + mean(lambda name: name == "gen", "peer_s"),
        # each phase ends at a barrier: a host phase's wait there is waiting for the slowest, not data or reward
        host_s={phase: mean(lambda name: name == phase, "comm_s") + mean(lambda name: name == phase, "peer_s")  # noqa: B023
                for phase in HOST_PHASES})


def _per_run(every: int, total: int, extra: int = 0) -> int:
    """How many times a run of ``total`` steps does something every ``every`` steps (0: only at the end), the
    last step always included, plus ``extra``."""
    if every <= 0:
        return 1 + extra
    return total // every + int(total % every != 0) + extra


def profile_waterfall(user_cfg: Config, kind: str, records: list[dict[str, Any]], metrics: dict[str, float],
                      context: dict[str, Any]) -> dict[str, Any]:
    """The MFU waterfall of the profiled steps (`scalerl.perf.mfu_waterfall`): the step's timers and counters
    (``metrics``, the mean over steps of the reduced metrics), the collective waits as measured here, and the
    evaluation and checkpoint save timed once each (the slowest rank) and spread over the run's steps at the
    config's intervals."""
    total = user_cfg.sft.steps if kind == "sft" else user_cfg.trainer.total_steps
    notes = []
    saves = [r["save_s"] for r in records if "save_s" in r]
    checkpoint_s = 0.0
    if saves:
        count = _per_run(user_cfg.trainer.save_every, total)
        checkpoint_s = max(saves) * count / max(1, total)
        notes.append(f"checkpointing: one save measured ({max(saves):.3f} s), {count} in a run of {total} steps "
                     f"(trainer.save_every={user_cfg.trainer.save_every})")
    evals = [r["eval_s"] for r in records if "eval_s" in r]
    eval_s = 0.0
    if evals:
        count = _per_run(user_cfg.trainer.eval_every, total, extra=int(kind == "rl"))  # RL also evaluates at start
        eval_s = max(evals) * count / max(1, total)
        notes.append(f"evaluation: one measured ({max(evals):.3f} s), {count} in a run of {total} steps "
                     f"(trainer.eval_every={user_cfg.trainer.eval_every})")
    waterfall = step_waterfall(metrics, layout=context, waits=measured_waits(records, metrics), eval_s=eval_s,
                               checkpoint_s=checkpoint_s)
    waterfall.notes += notes
    waterfall.steps = 0  # the mean of the profiled steps' metrics, not a count of records
    return {**waterfall.to_json(), "problems": waterfall.check()}
