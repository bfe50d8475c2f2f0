"""Predicted seconds of each phase of one rank, from the cost model (`scalerl.bench.cost_model`): compute at
per-phase rates (a fixed cost per call plus FLOPs at an effective rate) and every collective's alpha-beta
time, plus what the cost model leaves out and a plan needs: the AdamW step (seconds per parameter), the
checkpoint write (bytes at a checkpoint's write rate) and evaluation (a greedy generation of the validation rows).

Where the rates come from:

- ``cpu``: measured on this machine. `scalerl.bench.compute_probe` times forward + backward at two widths,
  forward-only passes and generation at two batch sizes on the config's own model (layers capped so the
  probe stays short; the fixed cost per call scaled back by the layer count), split by
  `scalerl.bench.calibration.probe_fit` into fixed and per-FLOP parts (each size timed in turns with the
  other, so a load change reads as neither); a fused AdamW step is timed over one large tensor (seconds per
  parameter) and, with the gradient-norm clip, over the model's own tensors (the rest is a fixed cost per
  step: a small model's step is its launches); the runtime's RSS is read in a fresh process that imports the trainer and builds the run's data;
  the rate a checkpoint's files are written at (`checkpoint_write_rate`); with more than one rank, the loopback link by
  all-reduce, all-gather and reduce-scatter sweeps between two gloo processes
  (`scalerl.bench.link_probe.timed_sweep`, each op fitted by `fit_link` on its own), each rank with the threads
  it will have, and what the layout adds per phase beyond all that (DDP's hooks, FSDP's and DTensor's wrappers,
  rollout workers' hand-offs) by running the config itself on a 32-wide model under its layout
  (`measure_layout_run`, in `scalerl.plan.cli.calibrate_layout`).
- a GPU (h100, h200, a100, ...): the datasheet's bf16 peak (`scalerl.perf.flops`) at an assumed MFU (stated,
  ``--mfu-train`` / ``--mfu-gen``), each decode step and AdamW step bounded by reading the weights at the
  datasheet's HBM bandwidth, and nominal links (`LINK_PRESETS`). Every such number is labelled assumed.
- ``--doctor REPORT.json`` (`DoctorMeasured`): what `scalerl doctor` measured on the cluster itself replaces
  the datasheet's guesses where it has them: the cluster's shape, GPU and memory, the links fitted to its
  intra- and inter-node all-reduce sweeps, the checkpoint directory's write speed, and with a
  ``--performance-profiling`` report the update's achieved MFU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scalerl.bench.cost_model.collective_cost import LINK_PRESETS, LinkCost, fit_link
from scalerl.bench.cost_model.step_projection import (
    ComputeRates,
    Links,
    TokenLengths,
    compute_seconds,
    project_step,
)
from scalerl.bench.cost_model.step_traffic import Layout, StepShape, step_collectives
from scalerl.perf.flops import datasheet_peak_flops
from scalerl.plan.memory import EVAL_CHUNK_ROWS, PlanSetup, decode_layout_bytes, policy_counts

PROBE_REPEATS = 3  # timed turns per probe size: the plan's probe is a few seconds, not a benchmark
PROBE_MAX_ACCUMULATE = 4  # micro-batches a training probe accumulates (the run's per optimizer step, at most)
PROBE_MAX_PARAMS = 120_000_000  # the compute probe builds the model: beyond this, fewer layers
# Datasheet HBM bandwidth (bytes/s): NVIDIA H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB SXM 2.039 TB/s,
# A100 40GB 1.555 TB/s, L40S 864 GB/s, AMD MI300X 5.3 TB/s.
HBM_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12, "a100-40gb": 1.555e12, "l40s": 0.864e12,
                   "mi300x": 5.3e12}
NVLINK = {"h100": "nvlink4", "h200": "nvlink4", "a100": "nvlink3"}
ADAM_BYTES_PER_PARAM = 28  # fp32: read param, grad, 2 moments (16 B); write param, 2 moments (12 B)
DEFAULT_MFU_TRAIN, DEFAULT_MFU_GEN = 0.35, 0.35


@dataclass
class Calibration:
    """Everything the times are computed from, with where each came from."""

    rates: ComputeRates
    adam_s_per_param: float
    disk_bytes_per_s: float
    intra: LinkCost
    inter: LinkCost
    runtime_bytes: float = 0.0
    threads_per_rank: int = 0
    source: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    optimizer_step_s: float = 0.0  # fixed seconds of one optimizer step (per-tensor launches, the norm's clip)
    layout_refresh_s_per_byte: float = 0.0  # the built-in engine laying its decode copy out again, per byte
    checkpoint_fixed_s: float = 0.0  # a checkpoint save's cost whatever its size (files, metadata, fsyncs)
    host_step_s: float = 0.0  # a step's host work besides its timed phases and the reward per row
    # seconds per step phase that the run's layout adds (DDP's hooks, FSDP's and DTensor's wrappers, the
    # collectives' latency as the ranks meet them, rollout workers' hand-offs) beyond the plain model's compute
    # and the alpha-beta time: the run itself on a 32-wide model, measured less planned (`measure_layout_run`)
    layout_s: dict = dataclasses.field(default_factory=dict)
    intra_ops: dict = dataclasses.field(default_factory=dict)  # {op: LinkCost} fitted alone where measured
    other_runnable: float = 0.0  # CPU: other processes runnable on this machine while it calibrated
    copy_bytes_per_s: float = 0.0  # a tensor copy's rate (bytes of the source per second); 0: not counted

    def to_dict(self) -> dict:
        return {"rates": self.rates.to_dict(), "adam_s_per_param": self.adam_s_per_param,
                "optimizer_step_s": self.optimizer_step_s, "layout_refresh_s_per_byte": self.layout_refresh_s_per_byte,
                "checkpoint_fixed_s": self.checkpoint_fixed_s, "host_step_s": self.host_step_s,
                "layout_s": dict(self.layout_s),
                "intra_ops": {op: link.to_dict() for op, link in self.intra_ops.items()},
                "other_runnable": self.other_runnable, "copy_bytes_per_s": self.copy_bytes_per_s,
                "disk_bytes_per_s": self.disk_bytes_per_s, "intra": self.intra.to_dict(),
                "inter": self.inter.to_dict(), "runtime_bytes": self.runtime_bytes,
                "threads_per_rank": self.threads_per_rank, "source": self.source, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        return cls(ComputeRates.from_dict(data["rates"]), data["adam_s_per_param"], data["disk_bytes_per_s"],
                   LinkCost.from_dict(data["intra"]), LinkCost.from_dict(data["inter"]),
                   data.get("runtime_bytes", 0.0), data.get("threads_per_rank", 0), data.get("source", ""),
                   list(data.get("notes", [])), data.get("optimizer_step_s", 0.0),
                   data.get("layout_refresh_s_per_byte", 0.0), data.get("checkpoint_fixed_s", 0.0),
                   data.get("host_step_s", 0.0), dict(data.get("layout_s", {})),
                   {op: LinkCost.from_dict(link) for op, link in data.get("intra_ops", {}).items()},
                   data.get("other_runnable", 0.0), data.get("copy_bytes_per_s", 0.0))


# ---------------------------------------------------------------- calibration: this CPU


def _probe_model_config(s: PlanSetup):
    cfg = s.model
    total = policy_counts(s)[0]
    if total <= PROBE_MAX_PARAMS:
        return cfg, 1.0
    root = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    per_layer = max(1, (total - root) / cfg.num_hidden_layers)
    layers = int(max(1, min(cfg.num_hidden_layers, (PROBE_MAX_PARAMS - root) // per_layer)))
    probe = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=None)
    return probe, (cfg.num_hidden_layers + 1) / (layers + 1)


def probe_rates(s: PlanSetup, adam_s_per_param: float) -> tuple[ComputeRates, float, float]:
    """The compute probe on the config's model (built here, random weights), fitted into per-phase rates; the
    fixed part of one optimizer step on that model (what ``adam_s_per_param`` does not explain: the norm clip, a
    launch per tensor); and the seconds per byte of the built-in engine's decode layout laid out again from it
    (0 where the model has no fused decode path)."""
    import torch

    from scalerl.bench.calibration import probe_fit
    from scalerl.bench.compute_probe import probe_compute
    from scalerl.models.decoder import build_model

    cfg, scale = _probe_model_config(s)
    model = build_model(dataclasses.replace(cfg, torch_dtype="float32"), seed=0).float()
    new_tokens = max(2, min(s.new_tokens, 16))
    start = time.perf_counter()
    # generation as the run's trainer runs it: the fused decode path over whole weights, the model's own
    # forward over sharded or tensor-parallel ones (standalone workers hold whole weights)
    fused = s.standalone or not (s.fsdp or s.layout.tp > 1)
    # the update's micro-batches accumulate into one set of gradients, freed and trimmed after the step
    accumulate = min(PROBE_MAX_ACCUMULATE, max(1, math.ceil(min(s.rows, s.mini_rows) / max(1, s.micro_rows))))
    probe = probe_compute(model, 0, max(1, s.micro_rows), new_tokens, repeats=PROBE_REPEATS, fused_decode=fused,
                          accumulate=accumulate)
    # a model probed with fewer layers: its step scaled by the parameters, not the layers (the norm clip and AdamW
    # are work per parameter; by the layers, a 1-layer probe's 136M-parameter embedding counted 12.5 times and
    # Qwen2.5-0.5B's step had 1.6-3.7 s "fixed"), less the per-parameter AdamW rate: the fixed part
    probe_params, params = sum(p.numel() for p in model.parameters()), policy_counts(s)[0]
    step_s = time_optimizer_step(model) * (params / probe_params if scale != 1 else 1.0)
    optimizer_fixed_s = optimizer_step_fixed_s(step_s, params, adam_s_per_param)
    refresh_s_per_byte = time_layout_refresh(model, torch.float32 if s.compute_bytes == 4 else torch.bfloat16)
    del model
    fit = probe_fit(cfg, probe)

    def rate(slope: float) -> float:
        return 1.0 / slope if slope > 0 else float("inf")

    (gen_fixed, gen_slope), (train_fixed, train_slope) = fit["gen"], fit["train"]
    forward_fixed, forward_slope = fit["forward"]
    rates = ComputeRates(gen_flops_per_s=rate(gen_slope), train_flops_per_s=rate(train_slope),
                         forward_flops_per_s=rate(forward_slope), other_s_per_row=0.0,
                         gen_step_s=gen_fixed * scale, train_call_s=train_fixed * scale,
                         forward_call_s=forward_fixed * scale,
                         source="measured here: compute probe on the config's architecture"
                                + (f" at {cfg.num_hidden_layers} layers (fixed costs x {scale:.2f})" if scale != 1 else "")
                                + ("" if probe["fused_decode"] else ", generation with the model's own forward")
                                + f", {torch.get_num_threads()} thread(s), micro-batch {s.micro_rows}, "
                                f"{new_tokens} new tokens, {time.perf_counter() - start:.0f} s")
    return rates, optimizer_fixed_s, refresh_s_per_byte


def time_layout_refresh(model, dtype, repeats: int = 3) -> float:
    """Median seconds per byte of `DecodeModel.refresh` on ``model`` in ``dtype``: what a colocated rank's weight
    sync does with the built-in engine (each matrix cast, fused and laid out for its kernel again). 0 where the
    model has no fused decode path (it then generates with its own forward)."""
    from scalerl.models.decode_model import DecodeModel, fused_decode_unsupported

    if fused_decode_unsupported(model) is not None:
        return 0.0
    layout = DecodeModel(model, dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layout.refresh()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / max(1, layout.weight_bytes)


def time_optimizer_step(model) -> float:
    """Median seconds of one optimizer step as the trainer takes it (`scalerl.trainer.optim`: fused AdamW,
    foreach where fused is refused; the gradient norm clipped first) on the model's own parameters. With
    `time_adamw`'s cost per parameter this splits a step into a fixed part (one launch per tensor: what a
    small model's step is) and a part per parameter."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt = torch.optim.AdamW(params, fused=True)
        opt.step()
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(params, foreach=True)
        opt.step()
    times = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    for p in params:
        p.grad = None
    return statistics.median(times)


def optimizer_step_fixed_s(step_s: float, params: int, adam_s_per_param: float) -> float:
    """The fixed part of an optimizer step of ``params`` parameters that took ``step_s``: what the cost per
    parameter (timed over one large tensor) does not explain, never negative."""
    return max(0.0, step_s - params * adam_s_per_param)


def time_copy(nbytes: int = 64 * 2**20) -> float:
    """Bytes per second of one tensor copy of ``nbytes`` (median of 5, float32) into a buffer allocated for
    that copy, as FSDP allocates its flat buffers at every collective. A fresh
    buffer over glibc's mmap ceiling (32 MB) comes from the kernel as new pages, each faulted in at its first
    write: measured here, 60 MB copied at 2.5 GB/s into a fresh buffer against 6.1 GB/s into a reused one, and
    FSDP's own copies of a 60 MB unit ran at 2.2-2.8 GB/s in the run (its profile). Under that ceiling a fresh
    buffer reuses freed heap pages, and the two rates meet."""
    import torch

    src = torch.randn(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        del dst  # freed first, as FSDP's previous buffer is
        start = time.perf_counter()
        dst = torch.empty_like(src)
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() * 4 / max(1e-9, statistics.median(times))


def _fsdp_collectives(collectives):
    """FSDP's own collectives of the step: its parameters' all-gathers and its gradients' reduce-scatters."""
    return [c for c in collectives
            if (c.kind, c.op) in (("param", "all_gather"), ("grad", "reduce_scatter")) and c.group.size > 1]


def fsdp_buffer_bytes(collectives) -> float:
    """The largest flat buffer FSDP allocates for one collective of the step (an all-gather's gathered unit or a
    reduce-scatter's input): the size its copies are timed at. 0 without FSDP."""
    return max((c.payload_bytes for c in _fsdp_collectives(collectives)), default=0.0)


def fsdp_copy_bytes(collectives) -> dict[str, float]:
    """Bytes FSDP copies around its collectives in one step, by kind: each all-gather copies the rank's shard
    into the flat input and the gathered tensor out into the layer's parameters (1/n + 1 of the payload); each
    reduce-scatter copies the gradients into the flat input and the reduced shard out (1 + 1/n)."""
    out: dict[str, float] = {}
    for c in _fsdp_collectives(collectives):
        out[c.kind] = out.get(c.kind, 0.0) + c.count * c.payload_bytes * (1 + 1 / c.group.size)
    return out


def time_adamw(params: int, fused: bool = True) -> float:
    """Seconds per parameter of one AdamW step, timed over a tensor of up to 8M float32 elements."""
    import torch

    n = int(max(2**16, min(params, 8 * 2**20)))
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    try:
        opt = torch.optim.AdamW([p], fused=fused)
        opt.step()
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([p], foreach=True)
        opt.step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n


# the built-in model at 32 wide (tests/tiny.py's shape): the layout probe's and the runtime probe's run
WIDTH_32 = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4",
            "model.num_key_value_heads=2"]

_RUNTIME_SCRIPT = """
import json, resource, sys, tempfile, time
import scalerl.trainer.rl_trainer  # the trainer and everything it imports
from scalerl.core.config import load_config
from scalerl.data.sources import reward_from_config, rows_from_config
cfg = load_config(sys.argv[1] or None, sys.argv[2:])
rows = [] if cfg.data.train_files else rows_from_config(cfg.data, "train", cfg.trainer.seed)
out = {"worked": "imports", "checkpoint_s": 0.0, "reward_s": 0.0}

def status_bytes(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

# VmHWM is this process's own peak; ru_maxrss is not: Linux carries the parent's resident set at the fork
# into it across exec, so a plan that had built a large probe model read that model as runtime.
try:
    out["runtime_bytes"] = status_bytes("VmHWM")
except (OSError, StopIteration):
    out["runtime_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# A trainer's runtime grows once it has run: the kernels' code paged in, the libraries' caches (0.30 GiB
# after the imports, 0.34 after two steps on the built-in model). Two steps of this run's trainer on a
# 32-wide copy of its built-in model, one process, measure that, and a checkpoint save of it times what a
# save costs whatever its size (directories, metadata, fsyncs). Not where the model is loaded from a path (its
# weights would be read) or the steps fail (then the imports' peak stands, and the plan says which).
if not cfg.model.path:
    try:
        from scalerl.trainer.rl_trainer import RLTrainer
        with tempfile.TemporaryDirectory() as scratch:
            tiny = [*sys.argv[2:], *WIDTH_32_LIST, "parallel.dp_replicate=1", "parallel.dp_shard=1",
                    "parallel.tp=1", "parallel.pp=1", "parallel.sp=1", "rollout.placement=colocated",
                    "rollout.engine=builtin", "rollout.staleness=0", "rollout.dtype=fp32", "rollout.stream_groups=false", "data.num_train=16", "data.num_val=0", "rollout.n=2",
                    "trainer.batch_size=2", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=4",
                    "rollout.max_new_tokens=4", "trainer.eval_every=0", "trainer.save_every=0", "trainer.total_steps=2",
                    "trainer.logger=[jsonl]", f"trainer.output_dir={scratch}", "trainer.overwrite=true"]
            trainer = RLTrainer.from_config(load_config(sys.argv[1] or None, tiny))
            trainer.train_step()
            steps = [trainer.train_step() for _ in range(2)]
            out["runtime_bytes"] = max(out["runtime_bytes"], status_bytes("VmRSS"))
            # the step's host work besides the phases the plan times (data, the reward's fixed part,
            # advantages, metrics): the step less those phases, the smaller of two steps
            timed = ("gen", "old_log_prob", "ref", "update_actor", "update_critic", "update_weights")
            out["host_step_s"] = min(max(0.0, m["timing_s/step"] - sum(m.get("timing_s/" + k, 0.0) for k in timed))
                                     for m in steps)
            saves = []
            for _ in range(3):
                start = time.perf_counter()
                trainer.save()
                saves.append(time.perf_counter() - start)
            out["checkpoint_s"] = sorted(saves)[1]
            out["worked"] = "steps"
            del trainer
    except Exception as exc:  # noqa: BLE001 - any failure leaves the imports' figure, said in the plan's notes
        out["worked"] = "imports (" + type(exc).__name__ + ")"
rows = rows[:32]
if rows and not cfg.data.reward_model.path and "judge" not in cfg.data.reward:  # a scorer, not a model
    reward = reward_from_config(cfg.data)
    texts = [str(r.get("prompt", ""))[-24:] for r in rows]  # any text: the scorer's time per response
    reward.compute(texts, rows)
    start = time.perf_counter()
    for _ in range(3):
        reward.compute(texts, rows)
    out["reward_s"] = (time.perf_counter() - start) / 3 / len(rows)
if "host_step_s" in out:  # the reward per response is planned per row: not twice (the run above scored 2 x 2)
    out["host_step_s"] = max(0.0, out["host_step_s"] - 4 * out["reward_s"])
print("RUNTIME " + json.dumps(out))
""".replace("WIDTH_32_LIST", repr(WIDTH_32))


@dataclass
class RuntimeProbe:
    """What `measure_runtime` read in a fresh process."""

    runtime_bytes: float  # a CPU rank's resident bytes besides its model's tensors
    reward_s: float  # the run's reward per response (0: a model or the user's data)
    checkpoint_s: float  # a checkpoint save of a 32-wide model (0: the steps did not run)
    worked: str  # "steps", or "imports (why not the steps)"
    host_step_s: float = 0.0  # a step's host work besides its timed phases and the reward per row


def measure_runtime(config_path: str | None, overrides: list[str]) -> RuntimeProbe:
    """A CPU rank's runtime, measured in a fresh process: the larger of its peak after importing the trainer
    and building the run's built-in data, and its resident set after two steps of the run's trainer on a
    32-wide model (what a rank holds besides its model's tensors once it has run); the seconds of a
    checkpoint save of that model (a save's fixed cost); the seconds the run's reward takes per response
    there (0 when the reward is a model or the data is the user's)."""
    import json

    done = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT, config_path or "", *overrides],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"runtime probe failed: {done.stderr[-2000:]}")
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("RUNTIME ")), None)
    if line is None:
        raise RuntimeError(f"runtime probe printed no result: {done.stdout[-500:]}")
    out = json.loads(line[len("RUNTIME "):])
    return RuntimeProbe(float(out["runtime_bytes"]), float(out["reward_s"]), float(out["checkpoint_s"]),
                        out["worked"], float(out.get("host_step_s", 0.0)))


# the first steps pay the warm-up (kernels paged in, buffers grown, and under tensor parallelism DTensor's
# sharding rules cached per new shape: a TP rank's generation took 3.5, 1.8, 0.9, 0.67 s in steps 1-4 here):
# the median of the steps after LAYOUT_PROBE_WARMUP
LAYOUT_PROBE_STEPS, LAYOUT_PROBE_WARMUP = 16, 4
MEASURED_PHASES = {"generation": ("timing_s/gen",), "old_log_prob": ("timing_s/old_log_prob",),
                   "ref_log_prob": ("timing_s/ref",), "update": ("timing_s/update_actor", "timing_s/update_critic"),
                   "weight_sync": ("timing_s/update_weights",)}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from /proc: what a session kill misses when a
    child starts its own sessions."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def measure_layout_run(config_path: str | None, overrides: list[str], processes: int, threads: int,
                       timeout_s: float = 300) -> dict[str, float]:
    """Seconds per step phase of the run itself, under its own layout, rank count and batch, on a 32-wide copy
    of its built-in model: ``processes`` ranks under torchrun (the rollout workers among them), ``threads`` each,
    ``LAYOUT_PROBE_STEPS`` steps, the median of those after the first ``LAYOUT_PROBE_WARMUP``. What a layout costs per call (DDP's hooks,
    FSDP's and DTensor's wrappers, a collective's latency as the ranks reach it, a worker's hand-off) does not
    depend on the width, so this run measures it where its FLOPs cost next to nothing. ``other`` is the step
    less its timed phases; ``peak_bytes`` the largest rank's peak resident set (a runtime under the layout)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="scalerl-plan-") as scratch:
        args = [*([config_path] if config_path else []), *overrides, *WIDTH_32, "data.num_val=0",
                "trainer.eval_every=0", "trainer.save_every=0", f"trainer.total_steps={LAYOUT_PROBE_STEPS}",
                "trainer.logger=[jsonl]", f"trainer.output_dir={scratch}/run", "trainer.overwrite=true"]
        launch = [sys.executable, "-m", "scalerl", "train"]
        if processes > 1:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                      "-m", "scalerl", "train"]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads))}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this machine's ranks: loopback
        # in the user's directory (relative paths in the config resolve as in the run); a timeout or Ctrl-C takes
        # torchrun and its ranks down
        proc = subprocess.Popen([*launch, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        def kill() -> None:
            # torchrun starts each rank in a session of its own, so a session kill misses them: stop the whole
            # tree first (a stopped process forks no more), until a scan finds nothing new, then kill it
            stopped: set[int] = set()
            while new := [p for p in (proc.pid, *_descendants(proc.pid)) if p not in stopped]:
                for pid in new:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                stopped.update(new)
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()

        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            kill()
            raise RuntimeError(f"the layout probe's run did not finish in {timeout_s:.0f} s") from exc
        except BaseException:  # Ctrl-C: no rank left behind
            kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"the layout probe's run exited {proc.returncode}: {(stderr or stdout)[-1500:]}")
        metrics = Path(scratch) / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    if not steps:
        raise RuntimeError("the layout probe's run logged no step")
    later = steps[LAYOUT_PROBE_WARMUP:] or steps[-1:]
    out = {phase: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in later)
           for phase, keys in MEASURED_PHASES.items()}
    out["step"] = statistics.median(r["timing_s/step"] for r in later)
    out["other"] = max(0.0, out["step"] - sum(out[p] for p in MEASURED_PHASES))
    out["peak_bytes"] = max(r.get("perf/max_memory_gb", 0.0) for r in steps) * 2**30  # the largest rank's RSS
    return out


def recalibrate_compute(s: PlanSetup, cal: Calibration, threads: int) -> Calibration:
    """``cal`` with its compute rates, optimizer step and layout refresh measured again on ``s``'s model (the
    rest kept): what the plan expects of that model in one plain process. A probe's fixed cost per call,
    fitted across two sizes of one model, holds work that grows with the width without FLOPs (elementwise
    passes, copies), so a larger model's calibration over-predicts a 32-wide one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        rates, fixed, refresh_s_per_byte = probe_rates(s, cal.adam_s_per_param)
    finally:
        torch.set_num_threads(before)
    rates = dataclasses.replace(rates, other_s_per_row=cal.rates.other_s_per_row)
    return dataclasses.replace(cal, rates=rates, optimizer_step_s=fixed, layout_refresh_s_per_byte=refresh_s_per_byte,
                               layout_s={})


def layout_residual(measured: dict[str, float], planned: dict[str, float]) -> dict[str, float]:
    """Per step phase, what the layout probe's run took beyond what the plan predicts for that same 32-wide run
    from a plain calibration of that model (`recalibrate_compute`): the layout's own cost, added to the
    full-size plan. Never negative (a plain model that over-predicts the small run says nothing about the
    layout)."""
    return {p: max(0.0, measured.get(p, 0.0) - planned.get(p, 0.0)) for p in STEP_PHASES}


LOOPBACK_OPS = ("all_reduce", "all_gather", "reduce_scatter")
LOOPBACK_MAX_BYTES = 256 * 2**20  # the sweep's largest message: a few seconds at gloo's loopback rates


def _loopback_rank(rank: int, port: int, queue, largest: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from scalerl.bench.link_probe import SIZES, timed_sweep

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        sizes = sorted({*SIZES, 16 * 2**20, largest})
        results = {op: timed_sweep(None, 2, sizes, op) for op in LOOPBACK_OPS}
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def measure_loopback(largest_bytes: float = 0.0) -> dict[str, LinkCost]:
    """Two gloo processes on loopback, a sweep of each of ``LOOPBACK_OPS`` (the bench's link probe) up to the
    run's largest collective (``largest_bytes``, at most ``LOOPBACK_MAX_BYTES``), each fitted alpha-beta on
    its own: gloo's all-gather and reduce-scatter into and out of flat tensors (as FSDP calls them) are not
    the all-reduce's share of the bytes, and its rate falls past the caches (measured here: a 60 MB all-gather
    1.3x and a reduce-scatter 1.7x an all-reduce of the same payload, where the ring formula says 0.5x and 1x;
    a 16 MB all-gather at 0.77 GB/s, a 60 MB one at 0.41)."""
    import torch.multiprocessing as mp

    from scalerl.core.net import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    largest = int(min(max(16 * 2**20, largest_bytes), LOOPBACK_MAX_BYTES))
    procs = [ctx.Process(target=_loopback_rank, args=(r, port, queue, largest)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return {op: fit_link([r["size"] for r in sweep], [r["time_s"] for r in sweep], op, 2, "gloo",
                         source=f"measured here: gloo {op.replace('_', '-')} sweep on loopback, 2 processes x 1 thread")
            for op, sweep in results.items()}


def checkpoint_write_rate(directory: str, nbytes: int = 64 * 2**20) -> float:
    """Bytes per second of checkpoint files written under ``directory`` as `save_checkpoint` writes them: a
    random tensor of ``nbytes`` serialized by ``torch.save`` and fsynced (`save_torch_state`), then read back for
    the manifest's sha256 (`sha256_of`). A raw fsynced write is faster: 1.35 GB/s on the Intel VM, where a
    checkpoint's files went at 0.5 GB/s (docs/plan.md: the 0.5B-shaped cells' saves had been planned 51-74% short)."""
    import uuid

    import torch

    from scalerl.checkpoint.atomic import save_torch_state, sha256_of
    from scalerl.doctor.storage import probe_dir

    path = probe_dir(directory)
    if not path.is_dir():
        path = Path(".").absolute()
    file = path / f".scalerl-plan-save-{uuid.uuid4().hex}.pt"
    tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))  # incompressible
    try:
        start = time.perf_counter()
        save_torch_state({"tensor": tensor}, file)
        sha256_of(file)
        return nbytes / (time.perf_counter() - start)
    finally:
        file.unlink(missing_ok=True)


def other_runnable(samples: int = 20, interval_s: float = 0.05, stat_path: str = "/proc/stat") -> float:
    """The mean number of other runnable threads on this machine (the kernel's ``procs_running`` less the
    reader itself), sampled over ``samples x interval_s`` seconds: the work the run's ranks will share the
    cores with on a shared machine. 0 where /proc/stat cannot be read."""
    counts = []
    for _ in range(samples):
        try:
            with open(stat_path) as f:
                line = next(x for x in f if x.startswith("procs_running"))
        except (OSError, StopIteration):
            return 0.0
        counts.append(max(0, int(line.split()[1]) - 1))
        time.sleep(interval_s)
    return statistics.mean(counts)


def cpu_contention(processes: int, threads: int, other: float, cores: int | None = None) -> float:
    """How much slower a rank computes than the plan's probes did: ``processes`` ranks of ``threads`` threads
    beside ``other`` runnable threads share ``cores``, where the probes ran as one process of ``threads``
    beside the same ``other`` (so a busy machine's share is counted once, in the probes, and only what the
    run's own ranks add is a factor). 1 where the cores are enough for all."""
    cores = max(1, cores or os.cpu_count() or 1)
    run = max(1.0, (processes * max(1, threads) + other) / cores)
    probe = max(1.0, (max(1, threads) + other) / cores)
    return run / probe


def calibrate_cpu(s: PlanSetup, config_path: str | None, overrides: list[str], threads: int,
                  output_dir: str) -> Calibration:
    import torch

    busy_before = other_runnable()  # before the probes add their own
    step, _ = step_shape(s)
    collectives = step_collectives(s.model, step, step_layout(s))
    copy_size = int(fsdp_buffer_bytes(collectives)) or 64 * 2**20
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        adam = time_adamw(policy_counts(s)[1])
        rates, optimizer_fixed, refresh_s_per_byte = probe_rates(s, adam)
        copy_rate = time_copy(copy_size)
    finally:
        torch.set_num_threads(before)
    probe = measure_runtime(config_path, overrides)
    runtime, reward_s_per_row = probe.runtime_bytes, probe.reward_s
    rates = dataclasses.replace(rates, other_s_per_row=reward_s_per_row)
    disk = checkpoint_write_rate(output_dir)
    # and again once they are done: a shared machine's load comes and goes, one second of it says little
    busy_after = other_runnable()
    busy = (busy_before + busy_after) / 2
    how = ("a fresh process that imported the trainer, built the data and ran two steps of this run on a 32-wide "
           "model" if probe.worked == "steps" else
           f"VmHWM of a fresh process that imported the trainer and built the data; its two steps on a 32-wide "
           f"model did not run: {probe.worked}")
    notes = [f"runtime RSS {runtime / 2**20:.0f} MiB (measured here: {how})",
             (f"checkpoint save {probe.checkpoint_s * 1e3:.0f} ms + bytes at the checkpoint write rate (the save of a 32-wide "
              "model, measured here)"),
             (f"host work {probe.host_step_s * 1e3:.1f} ms per step besides the timed phases and the reward per "
              "response (data, advantages, metrics: a 32-wide model's step less its phases, measured here)"),
             (f"decode layout refresh {refresh_s_per_byte * 2**30:.2f} s per GiB (colocated weight sync on the "
              "built-in engine, measured here on the probe's model)"),
             f"reward {reward_s_per_row * 1e3:.2f} ms per response (measured here on the run's data)",
             (f"AdamW step {adam * 1e9:.2f} ns per parameter + {optimizer_fixed * 1e3:.1f} ms per step (norm clip, "
              f"a launch per tensor) (measured here on the model, {threads} thread(s))"),
             (f"checkpoint files written at {disk / 1e6:.0f} MB/s (measured here under {output_dir}: a 64 MB tensor "
              "saved by torch.save, fsynced and read back for its sha256, as a checkpoint's files are)"),
             (f"tensor copy {copy_rate / 1e9:.1f} GB/s ({copy_size / 2**20:.0f} MB into a freshly allocated buffer, "
              "measured here): FSDP's copies into and out of its collectives' buffers, allocated at every call"),
             (f"machine busy: {busy:.1f} other runnable thread(s) on {os.cpu_count()} cores while calibrating "
              f"({busy_before:.1f} in the second before the probes, {busy_after:.1f} in the second after; /proc/stat "
              "procs_running; the probes ran beside them, the ranks will too)")]
    world = s.layout.world + s.layout.rollout_workers
    intra_ops: dict[str, LinkCost] = {}
    if world > 1:
        largest = max((c.payload_bytes for c in collectives), default=0.0)
        intra_ops = measure_loopback(largest)
        intra = intra_ops["all_reduce"]
        notes.append("loopback " + ", ".join(f"{op.replace('_', '-')} {link.bytes_per_s / 1e9:.2f} GB/s, "
                                             f"{link.alpha_s * 1e6:.0f} us" for op, link in intra_ops.items())
                     + " (measured here: gloo sweeps on loopback, 2 processes x 1 thread, each op fitted alone)")
    else:
        intra = LinkCost(0.0, float("inf"), "one rank: no link")
    return Calibration(rates, adam, disk, intra, intra, runtime, threads,
                       source=f"this machine's CPU ({os.cpu_count()} cores), {threads} thread(s) per rank: "
                              + rates.source, notes=notes, optimizer_step_s=optimizer_fixed,
                       layout_refresh_s_per_byte=refresh_s_per_byte, checkpoint_fixed_s=probe.checkpoint_s,
                       host_step_s=probe.host_step_s, intra_ops=intra_ops, other_runnable=busy,
                       copy_bytes_per_s=copy_rate)


# ---------------------------------------------------------------- calibration: datasheets


def datasheet_calibration(s: PlanSetup, device: str, link: str | None, mfu_train: float | None,
                          mfu_gen: float | None, disk_bytes_per_s: float, mfu_train_said: str = "") -> Calibration:
    """Rates from ``device``'s datasheet at an MFU given, measured (``mfu_train_said`` says where: a doctor
    report's profile) or assumed."""
    import torch

    name = device.lower()
    dtype = torch.bfloat16 if s.compute_bytes == 2 else torch.float32
    peak = datasheet_peak_flops(name.upper(), dtype)
    train, gen = mfu_train or DEFAULT_MFU_TRAIN, mfu_gen or DEFAULT_MFU_GEN
    train_said = mfu_train_said or ("given" if mfu_train else "assumed")
    hbm = next((v for k, v in HBM_BYTES_PER_S.items() if name.startswith(k)), None)
    if hbm is None:
        raise KeyError(f"no datasheet HBM bandwidth for {device!r}; known: {', '.join(HBM_BYTES_PER_S)}")
    weights = policy_counts(s)[0] * s.compute_bytes / s.layout.tp
    rates = ComputeRates(gen_flops_per_s=peak * gen, train_flops_per_s=peak * train, forward_flops_per_s=peak * train,
                         other_s_per_row=0.0, gen_step_s=weights / hbm,
                         source=f"datasheet: {device.upper()} {'bf16' if s.compute_bytes == 2 else 'fp32'} peak "
                                f"{peak / 1e12:.0f} TFLOP/s x MFU {train:g} (train, {train_said}) / {gen:g} (generation, "
                                f"{'given' if mfu_gen else 'assumed'}), each decode step reading the weights at "
                                f"{hbm / 1e12:.2f} TB/s (HBM datasheet)")
    intra = LINK_PRESETS[NVLINK.get(name[:4], "pcie5")]
    inter = LINK_PRESETS[link or "ib-ndr"]
    notes = [f"intra-node: {intra.source}", f"inter-node: {inter.source}",
             f"AdamW step: {ADAM_BYTES_PER_PARAM} bytes per parameter at the HBM datasheet bandwidth",
             (f"checkpoint writes at {disk_bytes_per_s / 1e9:.2f} GB/s per node (given, or measured here with "
              "torch.save, fsync and sha256)"),
             "device memory: the CUDA context and the allocator's fragmentation are not counted"]
    notes.append("FSDP's copies into and out of its collectives' buffers at half the HBM datasheet bandwidth "
                 "(a copy reads and writes)")
    return Calibration(rates, ADAM_BYTES_PER_PARAM / hbm, disk_bytes_per_s, intra, inter, 0.0, 0,
                       source=rates.source, notes=notes, copy_bytes_per_s=hbm / 2)


# ---------------------------------------------------------------- calibration: a doctor report of the cluster


def datasheet_device(gpu_name: str, memory_gb: float) -> str | None:
    """The datasheet key (`HBM_BYTES_PER_S`) of a GPU as torch names it ("NVIDIA H100 80GB HBM3"), or None."""
    name = gpu_name.upper().replace(" ", "")
    for key in ("h200", "h100", "a100", "l40s", "mi300x"):
        if key.upper() in name:
            return "a100-40gb" if key == "a100" and memory_gb < 50 else key
    return None


@dataclass
class DoctorMeasured:
    """What a `scalerl doctor --json` report measured on the cluster a plan is for (None: not in the report)."""

    source: str
    nodes: int
    devices_per_node: int
    device: str | None  # a datasheet key ("h100"), "cpu", or None for a GPU without a datasheet here
    memory_gb: float | None  # per device (a GPU's; a CPU node's memory over its ranks)
    intra: LinkCost | None
    inter: LinkCost | None
    disk_bytes_per_s: float | None  # the checkpoint directory's write speed, the slowest node's
    mfu_train: float | None  # the profiled update's achieved MFU (with --performance-profiling)
    notes: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def read(cls, path: str) -> DoctorMeasured:
        import json

        from scalerl.bench.calibration import doctor_link
        from scalerl.doctor.report import SCHEMA

        how = f"write one with `scalerl doctor --distributed-check --json {path}` on the cluster"
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--doctor {path}: cannot read it as JSON ({e}); {how}") from e
        if not isinstance(report, dict) or report.get("schema") != SCHEMA:
            got = report.get("schema") if isinstance(report, dict) else type(report).__name__
            raise ValueError(f"--doctor {path}: not a scalerl doctor report (schema {got!r}, expected "
                             f"{SCHEMA!r}); {how}")
        world, facts = report.get("world") or {}, report.get("ranks") or []
        if not facts:
            raise ValueError(f"--doctor {path}: the report holds no rank's facts; {how}")
        nodes = world.get("nodes") or {"": list(range(int(world.get("world_size") or len(facts))))}
        per_node = max(len(ranks) for ranks in nodes.values())
        gpus = [g for f in facts for g in f.get("gpus") or []]
        notes, device, memory_gb = [], "cpu", None
        if gpus:
            memory_gb = min(float(g["memory_gb"]) for g in gpus)
            device = datasheet_device(str(gpus[0]["name"]), memory_gb)  # None: --device must name one
        else:
            totals = [float(f["memory"]["total_gb"]) for f in facts if (f.get("memory") or {}).get("total_gb")]
            memory_gb = min(totals) / per_node if totals else None
        backend = "nccl" if gpus else "gloo"
        links = {"intra-node": None, "inter-node": None}
        for scope, ranks in (("intra-node", per_node), ("inter-node", len(nodes))):
            if ranks > 1:  # a link the cluster has
                try:
                    links[scope] = doctor_link(report, scope, backend)
                except ValueError as e:
                    notes.append(f"doctor report: {e}")
        speeds = [p["write_bytes_per_s"] for f in facts for p in f.get("paths") or []
                  if p.get("role") == "checkpoint" and p.get("write_bytes_per_s")]
        profile = report.get("measurements", {}).get("profile") or {}
        if not speeds and (profile.get("context") or {}).get("write_bytes_per_s"):
            speeds = [profile["context"]["write_bytes_per_s"]]
        mfu = (profile.get("metrics") or {}).get("perf/mfu/update") if gpus else None  # of the config it profiled
        source = (f"scalerl doctor report {path} ({report.get('created', 'undated')}: {sum(map(len, nodes.values()))} "
                  f"rank(s) on {len(nodes)} node(s)" + (f", {gpus[0]['name']}" if gpus else ", CPU") + ")")
        return cls(source, len(nodes), per_node, device, memory_gb, links["intra-node"], links["inter-node"],
                   min(speeds) if speeds else None, float(mfu) if mfu else None, notes)

    def apply(self, cal: Calibration, intra: bool, inter: bool, disk: bool) -> None:
        """Its measurements in place of a GPU plan's datasheet ones where asked (a link or disk speed given on the
        command line stays), each said in the calibration's notes. A CPU plan measures them all here: loopback
        fitted per op, the checkpoint write rate with a checkpoint's own serialization and hashing."""
        said, replaced = [], []  # new notes, and the prefixes of the notes they replace
        for scope, field_name, wanted, link in (("intra-node", "intra", intra, self.intra),
                                                ("inter-node", "inter", inter, self.inter)):
            if wanted and link is not None:
                setattr(cal, field_name, link)
                said.append(f"{scope}: {link.source} ({link.bytes_per_s / 1e9:.2f} GB/s, {link.alpha_s * 1e6:.0f} us)")
                replaced.append(f"{scope}:")
        if disk and self.disk_bytes_per_s:
            cal.disk_bytes_per_s = self.disk_bytes_per_s
            said.append(f"checkpoint writes at {self.disk_bytes_per_s / 1e9:.2f} GB/s per node (the doctor's raw fsynced "
                        "write: a save's serialization and sha256 are not in it)")
            replaced.append("checkpoint writes")
        cal.notes = said + [n for n in cal.notes if not n.startswith(tuple(replaced))] + self.notes
        cal.source = f"{cal.source}; calibrated from {self.source}"


# ---------------------------------------------------------------- phase times


def step_layout(s: PlanSetup) -> Layout:
    """The cost model's layout of ``s``: its rollout weights in rollout.dtype, every weight sync a full one."""
    return dataclasses.replace(s.layout, rollout_param_bytes=s.rollout_bytes, weight_sync_ratio=1.0)


def step_shape(s: PlanSetup) -> tuple[StepShape, TokenLengths]:
    forward = int(s.old_pass) + int(s.reference) + int(s.critic)
    lengths = TokenLengths(s.prompt_len or s.prompt_width, s.response_len or s.new_tokens)
    width = lengths.prompt + lengths.response
    micro = s.micro_rows
    if s.micro_max_tokens:
        micro = max(1, min(micro, int(s.micro_max_tokens // max(1.0, width))))
    step = StepShape(rows=s.rows, prompt_len=s.prompt_width, response_len=s.decode_steps, train_width=width,
                     micro_rows=micro, mini_rows=max(1, s.mini_rows), epochs=s.epochs, forward_passes=forward,
                     pp_width=s.prompt_width + s.new_tokens, act_bytes=s.act_bytes, param_bytes=s.param_bytes,
                     decode_waves=math.ceil(s.generated_rows / s.decoding_at_once(s.generated_rows)))
    return step, lengths


PHASE_OF_COMM = {"grad": "update", "param": "update", "tp": "update", "pp": "update", "sequence": "update",
                 "rollout": "generation", "weight_sync": "weight_sync", "metrics": "other"}


def phase_seconds(s: PlanSetup, cal: Calibration, contention: float = 1.0) -> dict[str, float]:
    """Seconds per phase of one trainer rank: the step's phases, and (once each time they run) checkpoint
    save and evaluation. ``other`` is the per-row host work (not probed: 0 unless calibrated)."""
    step, lengths = step_shape(s)
    layout = step_layout(s)
    estimate = project_step(s.model, step, layout, lengths, cal.rates, Links(cal.intra, cal.inter, cal.intra_ops), contention)
    out = {"generation": estimate.compute_s["gen"], "old_log_prob": 0.0, "ref_log_prob": 0.0,
           "update": estimate.compute_s["update"], "weight_sync": 0.0,
           "other": estimate.compute_s["other"] + cal.host_step_s * max(1.0, contention)}
    if s.activation_checkpointing:  # each micro-batch's forward runs again inside its backward (the probe's does not)
        again = dataclasses.replace(step, forward_passes=step.epochs)
        out["update"] += compute_seconds(s.model, again, layout, lengths, cal.rates, contention)["forward"]
    passes = int(s.old_pass) + int(s.reference) + int(s.critic)
    if passes:
        each = estimate.compute_s["forward"] / passes
        out["old_log_prob"] = each * (int(s.old_pass) + int(s.critic))
        out["ref_log_prob"] = each * int(s.reference)
    trainable = policy_counts(s)[1]
    out["update"] += step.optimizer_steps * (trainable / s.shard * cal.adam_s_per_param + cal.optimizer_step_s) \
        * max(1.0, contention)
    copies = {kind: n / cal.copy_bytes_per_s * max(1.0, contention)
              for kind, n in fsdp_copy_bytes(estimate.collectives).items()} if cal.copy_bytes_per_s > 0 else {}
    for kind, seconds in estimate.comm_s.items():
        seconds += copies.get(kind, 0.0)  # the copies go where their collective goes
        phase = PHASE_OF_COMM.get(kind, "other")
        if kind == "param" and s.fsdp:  # FSDP gathers: once per generation, per forward pass, per micro-batch
            calls = {"generation": 1, "old_log_prob": step.forward_passes * math.ceil(step.rows / step.micro_rows),
                     "update": 2 * step.micro_batches}
            whole = sum(calls.values())
            for name, n in calls.items():
                out[name] += seconds * n / whole
            continue
        out[phase] = out.get(phase, 0.0) + seconds
    if s.standalone and s.staleness >= 1:
        # Asynchronous: the workers generate the next batch while the trainer works on this one, so the trainer
        # waits only for what generation takes beyond its own work (the step is the longer of the two).
        trainer_work = sum(out[p] for p in ("old_log_prob", "ref_log_prob", "update", "weight_sync", "other"))
        out["generation"] = max(0.0, out["generation"] - trainer_work)
    for phase, seconds in cal.layout_s.items():  # measured under the run's own rank count: no contention factor
        out[phase] = out.get(phase, 0.0) + seconds
    total_params = policy_counts(s)[0]
    state = total_params * s.param_bytes / s.shard + 2 * trainable * (4 if s.lora_rank else s.param_bytes) / s.shard
    writers = min(s.layout.ranks_per_node, s.layout.world)  # the node's ranks share its disk
    out["checkpoint_save"] = (cal.checkpoint_fixed_s * max(1.0, contention)
                              + (state * writers / cal.disk_bytes_per_s if cal.disk_bytes_per_s > 0 else 0.0))
    if not s.standalone:  # a colocated built-in engine lays its decode copy out again at every sync
        out["weight_sync"] += decode_layout_bytes(s) * cal.layout_refresh_s_per_byte * max(1.0, contention)
    if s.eval_rows:
        chunk = min(s.eval_rows, EVAL_CHUNK_ROWS)
        eval_step = dataclasses.replace(step, rows=chunk, forward_passes=0,
                                        decode_waves=math.ceil(chunk / s.decoding_at_once(chunk)))
        chunks = math.ceil(s.eval_rows / EVAL_CHUNK_ROWS)
        out["evaluation"] = chunks * compute_seconds(s.model, eval_step, layout, lengths, cal.rates, contention)["gen"]
    return out


STEP_PHASES = ("generation", "old_log_prob", "ref_log_prob", "update", "weight_sync", "other")


def step_seconds(phases: dict[str, float]) -> float:
    return sum(phases.get(p, 0.0) for p in STEP_PHASES)
