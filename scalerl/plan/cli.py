"""`scalerl plan CONFIG [key=value ...] [--nodes N --devices-per-node G --device cpu|h100|a100|... --link ...]`:
before a run starts, per rank and phase its predicted time and peak memory (split into parts), the first phase
that would not fit with the fix, and recommendations, each with a one-line why. Nothing is run: on the CPU
the rates are calibrated by short probes of this machine (`scalerl.plan.timing`), elsewhere taken from
datasheets. docs/plan.md shows the output and how close it came to measured runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl.core.config import ConfigError, load_config, split_config_args
from scalerl.plan import EPILOG, add_plan_arguments
from scalerl.plan.memory import (
    DTYPE_BYTES,
    GIB,
    MIB,
    PHASES,
    PlanSetup,
    host_parts,
    phase_parts,
    policy_counts,
    sync_buffer_bytes,
    total,
    worker_parts,
)

# ---------------------------------------------------------------- the setup from a config


@dataclass
class Cluster:
    nodes: int = 1
    devices_per_node: int = 1
    device: str = "cpu"
    memory_gb: float | None = None
    link: str | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def capacity_bytes(self) -> float:
        from scalerl.bench.projection import DEVICE_MEMORY_GB

        if self.memory_gb is not None:
            return self.memory_gb * GIB
        if self.device == "cpu":
            from scalerl.perf.memory import memory_capacity_gb

            return memory_capacity_gb(__import__("torch").device("cpu")) * GIB / self.devices_per_node
        key = next((k for k in DEVICE_MEMORY_GB if self.device.lower().startswith(k)), None)
        if key is None:
            raise ConfigError(f"no datasheet memory for --device {self.device}; give --memory-gb")
        return DEVICE_MEMORY_GB[key] * GIB


def model_config(cfg: Any, model_name: str | None):
    if model_name:
        from scalerl.bench.cost_model.model_shapes import model_shape

        return model_shape(model_name)
    if cfg.model.path:
        from scalerl.models.hf_checkpoint import model_config_from_hf

        path = Path(cfg.model.path) / "config.json"
        return model_config_from_hf(json.loads(path.read_text()), source=str(path))
    from scalerl.models.load import builtin_model_config
    from scalerl.models.tokenizer import CharTokenizer

    return builtin_model_config(cfg.model, CharTokenizer())


def _prompt_lengths(cfg: Any, builtin_tokenizer: bool) -> tuple[float, int, str]:
    """(mean prompt tokens, longest prompt tokens or 0 when unknown, where they came from)."""
    if not cfg.data.train_files and builtin_tokenizer:
        from scalerl.data.sources import rows_from_config

        rows = rows_from_config(cfg.data, "train", cfg.trainer.seed)[:512]
        texts = [r["prompt"] for r in rows if isinstance(r.get("prompt"), str)]
        if texts:
            lengths = [len(t) + 1 for t in texts]
            return sum(lengths) / len(lengths), max(lengths), "from the built-in task's prompts (chars + BOS)"
    return cfg.data.max_prompt_length / 2, 0, "assumed: half of data.max_prompt_length (give --prompt-len)"


def setup_from_config(cfg: Any, cluster: Cluster, model_name: str | None = None, prompt_len: float | None = None,
                      response_len: float | None = None) -> tuple[PlanSetup, list[str]]:
    """The plan's inputs from a loaded config on ``cluster``, with what was assumed."""
    from scalerl.bench.cost_model.step_traffic import Layout
    from scalerl.core.algorithm_names import needs_critic

    notes: list[str] = []
    model = model_config(cfg, model_name)
    par = cfg.parallel
    standalone = cfg.rollout.placement == "standalone"
    workers = cfg.rollout.workers if standalone else 0
    trainers = cluster.world - workers
    inner = par.tp * par.pp * par.sp
    if trainers < 1 or trainers % inner:
        raise ConfigError(f"{cluster.world} ranks ({workers} rollout workers) do not divide into tp x pp x sp = {inner}")
    dp = trainers // inner
    shard = par.dp_shard if par.dp_shard > 0 else (dp // par.dp_replicate if par.dp_replicate > 0 else dp)
    replicate = par.dp_replicate if par.dp_replicate > 0 else dp // max(1, shard)
    if shard * replicate != dp:
        raise ConfigError(f"parallel.dp_replicate={par.dp_replicate} x parallel.dp_shard={par.dp_shard} does not "
                          f"make the {dp} data-parallel ranks of {trainers} trainer ranks")
    gpu = cluster.device != "cpu"
    precision = cfg.trainer.precision
    if precision == "auto":
        precision = "bf16" if gpu else "fp32"
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    autocast = 2 if precision in ("bf16", "fp16") else param_bytes
    fsdp_bytes = DTYPE_BYTES[cfg.trainer.fsdp_param_dtype]
    layout = Layout(dp_replicate=replicate, dp_shard=shard, tp=par.tp, pp=par.pp, sp=par.sp,
                    ranks_per_node=cluster.devices_per_node, backend="nccl" if gpu else "gloo",
                    rollout_workers=workers, rollout_param_bytes=DTYPE_BYTES[cfg.rollout.dtype])
    rows = math.ceil(cfg.trainer.batch_size * cfg.rollout.n / dp)
    exact = cfg.rollout.dtype == "fp32" and (not cfg.rollout.staleness or cfg.rollout.stale_logprobs == "behavior")
    recompute = precision != "fp32" or (standalone and not exact)  # as `scalerl.bench.run` models it
    lora = cfg.model.lora
    longest = 0
    if prompt_len is None:
        prompt_len, longest, said = _prompt_lengths(cfg, not cfg.model.path and not model_name)
        notes.append(f"mean prompt length {prompt_len:.1f} tokens: {said}"
                     + (f"; batches padded to the longest, {longest} (memory)" if longest else ""))
    new_tokens, decode_calls = cfg.rollout.max_new_tokens, 0
    agent = cfg.rollout.agent
    if agent.env:
        # A multi-turn episode is one trajectory: its turns and the environment's answers after the prompt, up to
        # the token budget the agent loop itself runs with; generation decodes the turns and prefills each answer
        from scalerl.rollout.agent.source import ENV_TOKENS_PER_TURN, agent_limits

        new_tokens = max(1, agent_limits(cfg).max_total_tokens - cfg.data.max_prompt_length)
        decode_calls = min(new_tokens, agent.max_turns * (cfg.rollout.max_new_tokens + 1) - 1)
        notes.append(f"multi-turn agent (rollout.agent.env={agent.env}): each episode planned at its token budget, "
                     f"{new_tokens} positions after the prompt ("
                     + ("rollout.agent.max_total_tokens" if agent.max_total_tokens else
                        f"rollout.agent.max_turns={agent.max_turns} x (rollout.max_new_tokens="
                        f"{cfg.rollout.max_new_tokens} + {ENV_TOKENS_PER_TURN} per environment answer)")
                     + f"), in at most {decode_calls} forward calls (each turn decoded, each environment answer "
                       "prefilled in one); the tools' time is not counted (scalerl doctor's tool-latency leaf "
                       "measures it)")
    if response_len is None:
        notes.append(f"every response taken to run to {new_tokens} new tokens "
                     + ("(training width; give --response-len for a mean trajectory)" if decode_calls else
                        "(decode steps; give --response-len for a mean)"))
    setup = PlanSetup(
        model=model, layout=layout, rows=rows, prompt_width=cfg.data.max_prompt_length,
        new_tokens=new_tokens, micro_rows=min(cfg.actor.ppo_micro_batch_size, rows),
        mini_rows=max(1, math.ceil(cfg.actor.ppo_mini_batch_size / dp)), prompt_len=prompt_len,
        response_len=response_len or 0.0, micro_max_tokens=cfg.actor.micro_batch_max_tokens,
        epochs=cfg.actor.ppo_epochs, old_pass=recompute,
        reference=bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward),
        critic=needs_critic(cfg.algorithm.adv_estimator), param_bytes=param_bytes,
        compute_bytes=min(param_bytes, autocast, fsdp_bytes if (shard > 1 or par.tp * par.pp > 1) else param_bytes),
        act_bytes=min(param_bytes, autocast), lora_rank=lora.rank, lora_targets=tuple(lora.target_modules),
        lora_base_bytes=DTYPE_BYTES[lora.base_dtype] if lora.base_dtype else 0,
        activation_checkpointing=cfg.model.activation_checkpointing, standalone=standalone,
        rollout_bytes=DTYPE_BYTES[cfg.rollout.dtype], weight_sync_mode=cfg.weight_sync.mode,
        bucket_bytes=int(cfg.weight_sync.bucket_mb * MIB), max_num_seqs=cfg.rollout.max_num_seqs,
        eval_rows=math.ceil(cfg.data.num_val * cfg.trainer.val_n / dp),
        export_bytes=param_bytes if cfg.trainer.export_dtype == "source" else DTYPE_BYTES[cfg.trainer.export_dtype],
        device=cluster.device, longest_prompt=longest, staleness=cfg.rollout.staleness if standalone else 0,
        decode_calls=decode_calls)
    return setup, notes


# ---------------------------------------------------------------- fits, fixes, recommendations


def first_unfit(s: PlanSetup, capacity: float) -> tuple[str, float] | None:
    """The first phase (in PHASES order) whose peak is over ``capacity`` bytes, and that peak."""
    for name, parts in phase_parts(s).items():
        if total(parts) > capacity:
            return name, total(parts)
    if s.standalone and total(worker_parts(s)) > capacity:
        return "generation (rollout worker)", total(worker_parts(s))
    return None


def _fits(s: PlanSetup, capacity: float, phase: str) -> bool:
    parts = phase_parts(s)
    if phase.startswith("generation (rollout worker)"):
        return total(worker_parts(s)) <= capacity
    return phase not in parts or total(parts[phase]) <= capacity


def _halvings(n: int) -> list[int]:
    """n // 2, n // 4, ... down to 1: the smaller sizes a fix tries, largest first."""
    sizes = []
    while n > 1:
        n //= 2
        sizes.append(n)
    return sizes


def _powers_of_two_dividing(n: int) -> list[int]:
    return [d for d in (2**i for i in range(1, 12)) if d <= n and n % d == 0]


def find_fix(s: PlanSetup, capacity: float, phase: str) -> tuple[str, str] | None:
    """The first change (cheapest in step time first) under which ``phase`` fits: (override, why)."""
    from dataclasses import replace

    lay = s.layout
    candidates: list[tuple[str, PlanSetup, str]] = []
    if phase in ("update", "old_log_prob", "ref_log_prob"):
        if not s.activation_checkpointing:
            candidates.append(("model.activation_checkpointing=true", s.replace(activation_checkpointing=True),
                               ("keeps one input per layer and recomputes each layer's activations in backward "
                                "(about a third more update compute)")))
        for rows in _halvings(s.micro_rows):
            candidates.append((f"actor.ppo_micro_batch_size={rows}", s.replace(micro_rows=rows),
                               (f"activations and logits scale with the micro-batch ({s.micro_rows} -> {rows} "
                                "sequences; the same optimizer steps, more passes)")))
    if phase.startswith("generation") or phase == "evaluation":
        for rows in _halvings(s.gen_rows):
            candidates.append((f"rollout.max_num_seqs={rows}", s.replace(max_num_seqs=rows),
                               (f"the KV cache scales with the rows decoding at once ({s.gen_rows} -> {rows}; "
                                "continuous batching refills finished slots)")))
    if phase == "weight_sync":
        if s.weight_sync_mode == "delta":
            candidates.append(("weight_sync.mode=full", s.replace(weight_sync_mode="full"),
                               "no snapshot of the workers' weights on the source rank (every sync sends all)"))
        mb = s.bucket_bytes / MIB
        while mb > 4:
            mb /= 2
            candidates.append((f"weight_sync.bucket_mb={mb:g}", s.replace(bucket_bytes=int(mb * MIB)),
                               "a smaller bucket gathered and encoded at a time"))
    dp = lay.dp
    for degree in _powers_of_two_dividing(dp):
        if degree > lay.dp_shard:
            candidates.append((f"parallel.dp_shard={degree} parallel.dp_replicate={dp // degree}",
                               s.replace(layout=replace(lay, dp_shard=degree, dp_replicate=dp // degree)),
                               f"FSDP shards parameters, gradients and AdamW state over {degree} ranks"))
    if s.lora_rank <= 0:
        candidates.append(("model.lora.rank=16", s.replace(lora_rank=16, lora_targets=("all-linear",)),
                           "only the adapters get gradients and AdamW state (a different method: LoRA)"))
    for override, changed, why in candidates:
        if _fits(changed, capacity, phase):
            return override, why
    return None


def recommendations(s: PlanSetup, cal: Any, capacity: float) -> list[tuple[str, str]]:
    """(setting, why) for placement, FSDP/TP degrees, micro-batch and bucket size, from the memory model and
    the cost model's step time."""
    from dataclasses import replace

    from scalerl.plan.timing import phase_seconds, step_seconds

    out: list[tuple[str, str]] = []
    lay = s.layout
    trainers = lay.world

    def fits_all(x: PlanSetup) -> bool:
        return first_unfit(x, capacity) is None

    # FSDP / TP degrees: every (tp, dp_shard) over the trainer ranks, fastest that fits
    options = []
    for tp in [1] + _powers_of_two_dividing(min(trainers, lay.ranks_per_node)):
        if s.model.num_key_value_heads % tp or s.model.num_attention_heads % tp or trainers % (tp * lay.pp * lay.sp):
            continue
        dp = trainers // (tp * lay.pp * lay.sp)
        for shard in [1] + _powers_of_two_dividing(dp):
            x = s.replace(layout=replace(lay, tp=tp, dp_shard=shard, dp_replicate=dp // shard),
                          rows=math.ceil(s.rows * lay.dp / dp), mini_rows=max(1, math.ceil(s.mini_rows * lay.dp / dp)))
            if fits_all(x):
                options.append((step_seconds(phase_seconds(x, cal)), tp, shard, dp))
    if options:
        best = min(options)
        seconds, tp, shard, dp = best
        out.append((f"parallel.tp={tp} parallel.dp_shard={shard} parallel.dp_replicate={dp // shard}",
                    (f"the fastest layout that fits every phase: {seconds:.3g} s per step predicted over "
                     f"{len(options)} that fit ({'no sharding needed' if shard == 1 and tp == 1 else 'sharded'})")))
    else:
        out.append(("more devices, or model.lora.rank", "no TP / FSDP degree over these ranks fits every phase"))
    # placement
    if not s.standalone:
        gen = phase_parts(s).get("generation", {})
        share = gen.get("kv_cache", 0) / capacity if capacity else 0
        out.append(("rollout.placement=colocated", ("every rank generates with the trained weights in place: no "
                    f"weight sync, no idle devices (the KV cache takes {100 * share:.0f}% of a rank's memory)")))
    else:
        colocated = s.replace(standalone=False, layout=replace(lay, rollout_workers=0))
        if fits_all(colocated):
            out.append(("rollout.placement=colocated", ("it fits colocated, which generates on every rank and "
                        "skips the weight sync; standalone pays off with async rollouts (rollout.staleness >= 1)")))
        else:
            out.append(("rollout.placement=standalone", ("colocated would not fit: generation's KV cache beside "
                        "the training state")))
    # micro-batch: the largest that fits the update with 10% headroom
    best_micro = None
    rows = 1
    while rows <= max(1, s.mini_rows):
        x = s.replace(micro_rows=rows)
        if total(phase_parts(x)["update"]) <= 0.9 * capacity:
            best_micro = rows
        rows *= 2
    if best_micro:
        out.append((f"actor.ppo_micro_batch_size={best_micro}",
                    ("the largest power-of-two micro-batch whose update peak stays under 90% of the memory "
                     f"({s.train_width * best_micro} padded tokens per pass; fewer, larger passes cost less "
                     "fixed time)")))
    elif not s.activation_checkpointing:
        out.append(("model.activation_checkpointing=true actor.ppo_micro_batch_size=1",
                    "not even one sequence per micro-batch fits the update without recomputation"))
    # weight-sync bucket: latency under 5% of the bandwidth term, within the memory headroom
    if s.standalone:
        link = cal.intra
        floor = 20 * link.alpha_s * link.bytes_per_s if math.isfinite(link.bytes_per_s) else 4 * MIB
        headroom = capacity - total(phase_parts(s).get("weight_sync", {})) + sync_buffer_bytes(s)
        size = max(4 * MIB, min(2 ** math.ceil(math.log2(max(floor, 1))), headroom / 4))
        out.append((f"weight_sync.bucket_mb={size / MIB:.0f}",
                    (f"per-bucket latency {link.alpha_s * 1e6:.0f} us stays under 5% of its transfer at "
                     f"{link.bytes_per_s / 1e9:.1f} GB/s, and two buckets fit beside the training state")))
    else:
        out.append(("weight_sync.bucket_mb (unused)", "colocated generation reads the trained weights in place"))
    return out


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    setup: PlanSetup
    cluster: Cluster
    capacity_bytes: float
    memory: dict[str, dict[str, float]]
    seconds: dict[str, float]
    worker_memory: dict[str, float] | None
    host: dict[str, float]
    calibration: Any
    notes: list[str] = field(default_factory=list)
    unfit: tuple[str, float] | None = None
    fix: tuple[str, str] | None = None
    advice: list[tuple[str, str]] = field(default_factory=list)
    # the update with activation checkpointing off and on: {"off"|"on": {activations_gb, peak_gb, seconds}}
    checkpointing: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from scalerl.plan.timing import step_seconds

        s = self.setup
        return {
            "schema": "scalerl.plan/1",
            "cluster": self.cluster.__dict__, "capacity_gb": self.capacity_bytes / GIB,
            "layout": {"dp_replicate": s.layout.dp_replicate, "dp_shard": s.layout.dp_shard, "tp": s.layout.tp,
                       "pp": s.layout.pp, "sp": s.layout.sp, "rollout_workers": s.layout.rollout_workers},
            "rows_per_rank": s.rows, "micro_rows": s.micro_rows,
            "memory_gb": {p: {k: v / GIB for k, v in parts.items()} | {"total": total(parts) / GIB}
                          for p, parts in self.memory.items()},
            "peak_memory_gb": max(total(p) for p in self.memory.values()) / GIB,
            "worker_memory_gb": None if self.worker_memory is None else
            {k: v / GIB for k, v in self.worker_memory.items()} | {"total": total(self.worker_memory) / GIB},
            "host_gb": {k: v / GIB for k, v in self.host.items()},
            "seconds": self.seconds, "step_seconds": step_seconds(self.seconds),
            "first_unfit": None if self.unfit is None else {"phase": self.unfit[0], "peak_gb": self.unfit[1] / GIB,
                                                            "fix": self.fix[0] if self.fix else None,
                                                            "why": self.fix[1] if self.fix else None},
            "recommendations": [{"setting": a, "why": b} for a, b in self.advice],
            "update_activation_checkpointing": self.checkpointing,
            "calibration": self.calibration.to_dict(), "notes": self.notes,
        }


def calibrate_layout(cfg: Any, cluster: Cluster, setup: PlanSetup, calibration: Any, config_path: str | None,
                     overrides: list[str], threads: int, contention: float) -> str | None:
    """On this machine with more than one process (ranks or rollout workers): run the config itself on a
    32-wide model under its layout and set ``calibration.layout_s`` to what each phase took beyond what a
    plain calibration of that 32-wide model plans for it; the note saying so (None when there is one process, so nothing to
    measure). Not where the model or the reward is a model loaded from a path (the small run would load it)."""
    from scalerl.plan import timing

    if cluster.world == 1:
        return None
    if cfg.model.path or cfg.data.reward_model.path or "judge" in str(cfg.data.reward):
        return ("layout cost not measured: the model or the reward loads weights from a path (the plan times the "
                "plain model and the collectives' alpha-beta time only)")
    start = time.perf_counter()
    try:
        measured = timing.measure_layout_run(config_path, overrides, cluster.world, threads)
    except (RuntimeError, OSError, ValueError) as exc:
        return f"layout cost not measured ({str(exc).splitlines()[0][:200]}): plain model and alpha-beta only"
    small, _ = setup_from_config(load_config(config_path, [*overrides, *timing.WIDTH_32]), cluster)
    small = small.replace(prompt_len=setup.prompt_len, response_len=setup.response_len)
    planned = timing.phase_seconds(small, timing.recalibrate_compute(small, calibration, threads), contention)
    calibration.layout_s = timing.layout_residual(measured, planned)
    added = ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in calibration.layout_s.items() if v >= 5e-4) or "nothing"
    # A rank under the layout holds more runtime than one plain process (the distributed stack's heap and code:
    # 26-34 MiB more on the 0.5B-shaped TP cell's ranks, measured); the small run's peak is that runtime, its
    # 32-wide model's tensors being a fraction of a MiB.
    runtime = ""
    if measured.get("peak_bytes", 0.0) > calibration.runtime_bytes:
        runtime = (f"; runtime RSS {measured['peak_bytes'] / 2**20:.0f} MiB under the layout (its largest rank), "
                   f"over the plain process's {calibration.runtime_bytes / 2**20:.0f}")
        calibration.runtime_bytes = measured["peak_bytes"]
    return (f"layout cost per step {added} (measured here: this run on a 32-wide model under its layout, "
            f"{cluster.world} processes, {timing.LAYOUT_PROBE_STEPS} steps, less what a plain calibration of that "
            f"model plans for it; {time.perf_counter() - start:.0f} s){runtime}")


def make_plan(cfg: Any, cluster: Cluster, *, config_path: str | None = None, overrides: list[str] | None = None,
              model_name: str | None = None, prompt_len: float | None = None, response_len: float | None = None,
              mfu_train: float | None = None, mfu_gen: float | None = None, disk_bytes_per_s: float | None = None,
              calibration: Any = None, recommend: bool = True, widths: dict[str, int] | None = None,
              doctor: Any = None) -> Plan:
    """The plan of ``cfg`` on ``cluster``. ``widths`` (``prompt_width``, ``new_tokens``) replace the config's
    lengths for a named model, whose positions the built-in model's config check does not know. ``doctor``
    (`timing.DoctorMeasured`): a doctor report's measurements of the cluster, in place of the datasheet's
    links, disk speed and update MFU (a stored ``calibration`` is used as it is)."""
    from scalerl.plan import timing

    setup, notes = setup_from_config(cfg, cluster, model_name, prompt_len, response_len)
    if widths:
        setup = setup.replace(**widths)
        if prompt_len is None and "prompt_width" in widths:
            setup = setup.replace(prompt_len=widths["prompt_width"] / 2)
        notes = [n for n in notes if not n.startswith(("mean prompt length", "every response"))]
        notes.append(f"mean prompt length {setup.prompt_len or setup.prompt_width:g} tokens"
                     + ("" if prompt_len else " (assumed: half the prompt width; give --prompt-len)"))
        if response_len is None:
            notes.append(f"every response taken to run to {setup.new_tokens} new tokens (give --response-len)")
    threads = 0
    calibrated_here = calibration is None  # a stored calibration (--calibration) is used as it is
    if cluster.device == "cpu":
        threads = cfg.trainer.cpu_threads or max(1, (os.cpu_count() or 1) // cluster.devices_per_node)
        if calibration is None:
            calibration = timing.calibrate_cpu(setup, config_path, list(overrides or []), threads, cfg.trainer.output_dir)
        setup = setup.replace(runtime_bytes=calibration.runtime_bytes)
    elif calibration is None:
        disk = disk_bytes_per_s or (doctor and doctor.disk_bytes_per_s) or timing.checkpoint_write_rate(cfg.trainer.output_dir)
        profiled = not mfu_train and doctor is not None and doctor.mfu_train
        calibration = timing.datasheet_calibration(setup, cluster.device, cluster.link,
                                                   doctor.mfu_train if profiled else mfu_train, mfu_gen, disk,
                                                   mfu_train_said="measured by the doctor's profile" if profiled else "")
    if doctor is not None and calibrated_here and cluster.device != "cpu":  # the CPU plan measures all of this here
        doctor.apply(calibration, intra=True, inter=not cluster.link, disk=not disk_bytes_per_s)
    if disk_bytes_per_s:
        calibration.disk_bytes_per_s = disk_bytes_per_s
    capacity = cluster.capacity_bytes()
    contention = 1.0
    if cluster.device == "cpu":
        contention = timing.cpu_contention(cluster.devices_per_node, threads, calibration.other_runnable)
        if contention > 1.0:
            notes.append(f"{cluster.devices_per_node} rank(s) x {threads} thread(s) beside "
                         f"{calibration.other_runnable:.1f} other runnable thread(s) on {os.cpu_count()} cores: "
                         f"compute {contention:.2f}x the probes' (which ran as one process beside the same)")
    if cluster.device == "cpu" and calibrated_here:
        note = calibrate_layout(cfg, cluster, setup, calibration, config_path, list(overrides or []), threads,
                                contention)
        if note:
            calibration.notes.append(note)
    seconds = timing.phase_seconds(setup, calibration, contention)
    memory = phase_parts(setup)
    plan = Plan(setup, cluster, capacity, memory, seconds, worker_parts(setup) if setup.standalone else None,
                host_parts(setup, cluster.device != "cpu"), calibration, notes)
    for on in (False, True):  # the update both ways: as configured, and flipped
        flipped = setup.replace(activation_checkpointing=on)
        same = on == setup.activation_checkpointing
        update = memory["update"] if same else phase_parts(flipped)["update"]
        update_s = seconds["update"] if same else timing.phase_seconds(flipped, calibration, contention)["update"]
        plan.checkpointing["on" if on else "off"] = {"activations_gb": update["activations"] / GIB,
                                                      "peak_gb": total(update) / GIB, "seconds": update_s}
    plan.unfit = first_unfit(setup, capacity)
    if plan.unfit:
        plan.fix = find_fix(setup, capacity, plan.unfit[0])
    if recommend:
        plan.advice = recommendations(setup, calibration, capacity)
    return plan


def _gb(x: float) -> str:
    return f"{x / GIB:.3f}" if x < 10 * GIB else f"{x / GIB:.1f}"


def render(plan: Plan, out=None) -> None:
    from scalerl.plan.timing import step_seconds

    out = out or sys.stdout
    s, lay = plan.setup, plan.setup.layout
    w = out.write
    w(f"scalerl plan: {plan.cluster.nodes} node(s) x {plan.cluster.devices_per_node} {plan.cluster.device} "
      f"rank(s), {plan.capacity_bytes / GIB:.1f} GiB per rank\n")
    w(f"  model: {s.model.num_hidden_layers} layers, hidden {s.model.hidden_size}, vocab {s.model.vocab_size}, "
      f"{policy_counts(s)[0] / 1e6:.1f}M parameters\n")
    w(f"  layout: dp_replicate={lay.dp_replicate} dp_shard={lay.dp_shard} tp={lay.tp} pp={lay.pp} sp={lay.sp}"
      f"{f' + {lay.rollout_workers} rollout worker(s)' if lay.rollout_workers else ''}; {s.rows} sequences per "
      f"DP rank, micro-batch {s.micro_rows} x {s.train_width} tokens\n")
    w(f"  calibration: {plan.calibration.source}\n")
    for note in plan.calibration.notes + plan.notes:
        w(f"    - {note}\n")
    parts = ["parameters", "reference", "critic", "gradients", "gradient_temporaries", "optimizer", "ddp_buckets", "generation_replica",
             "decode_layout", "gathered_weights", "activations", "logits", "kv_cache", "weight_sync_buckets",
             "delta_snapshot", "layout_rebuild", "checkpoint_spike", "runtime"]
    used = [p for p in parts if any(p in m for m in plan.memory.values())]
    header = ["phase", "time s", "peak GiB", *used]
    rows = []
    for phase in PHASES:
        if phase not in plan.memory and phase not in plan.seconds:
            continue
        mem = plan.memory.get(phase)
        rows.append([phase, f"{plan.seconds.get(phase, 0.0):.3g}", _gb(total(mem)) if mem else "-",
                     *[_gb(mem[p]) if mem and p in mem else "" for p in used]])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    w("\n  per trainer rank (memory in GiB):\n")
    for r in [header, *rows]:
        w("    " + "  ".join(str(c).rjust(widths[i]) if i else str(c).ljust(widths[i]) for i, c in enumerate(r)) + "\n")
    w(f"    step (generation + log-probs + update + weight sync + other): {step_seconds(plan.seconds):.3g} s; "
      "checkpoint save and evaluation when they run\n")
    if plan.worker_memory is not None:
        w("  per rollout worker: " + ", ".join(f"{k} {_gb(v)}" for k, v in plan.worker_memory.items())
          + f" = {_gb(total(plan.worker_memory))} GiB\n")
    w("  host RAM per node (GiB): " + ", ".join(f"{k} {_gb(v)}" for k, v in plan.host.items()) + "\n")
    if plan.checkpointing:
        now, other = ("on", "off") if s.activation_checkpointing else ("off", "on")
        a, b = plan.checkpointing[now], plan.checkpointing[other]
        w(f"  update with activation checkpointing {now} (as configured): activations {a['activations_gb']:.3g} GiB, "
          f"peak {a['peak_gb']:.3g} GiB, {a['seconds']:.3g} s; with model.activation_checkpointing="
          f"{'false' if now == 'on' else 'true'}: activations {b['activations_gb']:.3g} GiB, peak {b['peak_gb']:.3g} "
          f"GiB, {b['seconds']:.3g} s (checkpointing recomputes each micro-batch's forward in its backward)\n")
    if plan.unfit:
        phase, peak = plan.unfit
        w(f"\n  DOES NOT FIT: {phase} needs {_gb(peak)} GiB of {plan.capacity_bytes / GIB:.1f} GiB per rank\n")
        if plan.fix:
            w(f"    fix: {plan.fix[0]}  ({plan.fix[1]})\n")
        else:
            w("    no single change tried fits it: more ranks, a smaller model or shorter sequences\n")
    else:
        w(f"\n  fits: every phase under {plan.capacity_bytes / GIB:.1f} GiB per rank "
          f"(peak {_gb(max(total(m) for m in plan.memory.values()))} GiB)\n")
    if plan.advice:
        w("\n  recommendations:\n")
        for setting, why in plan.advice:
            w(f"    {setting}: {why}\n")


def run_plan_command(args: argparse.Namespace) -> int:
    from scalerl.plan import timing

    try:
        path, overrides = split_config_args(list(args.config_args))
        widths = {}
        if args.model:  # the named model's lengths, kept from the built-in model's position check
            keys = {"data.max_prompt_length": "prompt_width", "rollout.max_new_tokens": "new_tokens"}
            widths = {keys[o.split("=", 1)[0]]: int(o.split("=", 1)[1]) for o in overrides if o.split("=", 1)[0] in keys}
            overrides = [o for o in overrides if o.split("=", 1)[0] not in keys]
        cfg = load_config(path, overrides)
        doctor = timing.DoctorMeasured.read(args.doctor) if args.doctor else None
        measured = vars(doctor) if doctor else {}  # the report's cluster, where not given here
        nodes = args.nodes if args.nodes is not None else measured.get("nodes", 1)
        per_node = args.devices_per_node if args.devices_per_node is not None else measured.get("devices_per_node", 1)
        device = args.device or measured.get("device", "cpu")
        if device is None:
            raise ConfigError(f"--doctor {args.doctor}: no datasheet here for its GPU (known: "
                              f"{', '.join(timing.HBM_BYTES_PER_S)}); name the closest with --device")
        memory_gb = args.memory_gb if args.memory_gb is not None else (
            measured.get("memory_gb") if device == measured.get("device") else None)  # the report's device's
        if nodes < 1 or per_node < 1:
            raise ConfigError("--nodes and --devices-per-node must be >= 1")
        if device == "cpu" and nodes > 1:
            raise ConfigError(f"--device cpu plans this machine: --nodes 1 (the {nodes} nodes "
                              + (f"of {args.doctor}" if doctor and args.nodes is None else "given")
                              + " need a GPU named to project a cluster: --device h100 ...)")
        calibration = None
        if args.calibration:
            calibration = timing.Calibration.from_dict(json.loads(Path(args.calibration).read_text())["calibration"])
        plan = make_plan(cfg, Cluster(nodes, per_node, device, memory_gb, args.link),
                         config_path=path, overrides=overrides, model_name=args.model, prompt_len=args.prompt_len,
                         response_len=args.response_len, mfu_train=args.mfu_train, mfu_gen=args.mfu_gen,
                         disk_bytes_per_s=args.disk_gb_per_s * 1e9 if args.disk_gb_per_s else None,
                         calibration=calibration, recommend=not args.no_recommend, widths=widths, doctor=doctor)
    except (ConfigError, KeyError, ValueError) as e:
        print(f"scalerl plan: {e}", file=sys.stderr)
        return 2
    render(plan)
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=1, default=str))
        print(f"\nplan written to {args.json}")
    return 1 if plan.unfit else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scalerl plan", description=__doc__.splitlines()[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(parser)
    return run_plan_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
