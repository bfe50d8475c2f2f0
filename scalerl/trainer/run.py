"""One run around a trainer's step, for RL and SFT alike: the entry, the set-up, resume, the loop with its
evaluation and save cadence, the step's tail, save and export.

`start_run(cfg, kind)` is the entry every way in takes (`train`, `train_sft`, `from_config`, the doctor,
the benchmark cells): it validates the config and checks what it names outside itself (`check_run_inputs`)
once, then joins the process group (the one place the distributed context is built). A `TrainingRun`
subclass takes that context and trusts its config; its ``__init__`` reads top to bottom, calling the
scaffold's pieces between its own:

    super().__init__(cfg, ctx, ...)   seed, device, output directory claimed (or resumed), section timer
    load_model()                      model + tokenizer, autocast
    lay_out(model)                    `parallelize` with the run's layout options
    use_optimizer(...)                grad scaler and the `OptimizerStep` (wrapped, for a harness)
    resume(...)                       thread governor, skipped-step guard, the checkpoint loaded if any
    start_logging()                   metrics logger, health monitor, comm counters zeroed

`local_step` wraps the trainer's own `run_step` (which returns its metrics and the `StepWork` it did) in
what every step ends with: the learning-rate schedule, the gradient reducers' traffic, timers popped,
``timing_s/step``, ``perf/*``, the comm counters popped and ``timing_s/busy``. Harnesses use seams, not
private members: ``timer=`` (the doctor's `PhaseProfiler`), ``wrap_optimizer_step=`` (timing each
optimizer call) and, on the RL trainer, ``on_batch=`` (the bench's baselines).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from scalerl import checkpoint
from scalerl.checkpoint.streamed_export import export_dtype
from scalerl.comm.gradients.reducer import merged_comm_metrics
from scalerl.core.config import Config, ConfigError, byte_size, config_to_dict
from scalerl.core.device import Autocast, compute_dtype, grad_scaler, resolve_device
from scalerl.core.rng_state import seed_everything
from scalerl.core.threads import cpu_thread_governor
from scalerl.health.monitor import HealthMonitor
from scalerl.models.hf_checkpoint import model_config_to_hf
from scalerl.models.load import load_model_and_tokenizer
from scalerl.models.lora import apply_lora_from_config, has_lora, lora_enabled, save_adapter
from scalerl.models.sharded_loading import is_on_meta, load_local_shards
from scalerl.parallel.distributed import DistContext, init_distributed
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.parallel.parallelize import ModelParts, PipelineOptions, parallelize
from scalerl.perf.memory import max_memory_gb
from scalerl.perf.mfu import RankShare, StepWork, step_mfu
from scalerl.perf.precision import choose_precision
from scalerl.perf.timing import StepTimer, busy_time
from scalerl.rollout.batch import RolloutBatch
from scalerl.tracking import MetricsLogger
from scalerl.trainer.run_checks import check_run_inputs
from scalerl.trainer.run_directory import (
    CHECKPOINTS_DIR,
    prepare_output_dir,
    resume_from_checkpoint,
    say,
)
from scalerl.trainer.run_failures import RunStopped, SkippedStepGuard, StopSignals, stopped_message
from scalerl.trainer.update import OptimizerStep


def run_output_dir(cfg: Config, kind: str) -> Path:
    """Where a run of ``kind`` ("rl" or "sft") writes: ``trainer.output_dir``, SFT's ``sft.output_dir`` (by
    default ``<trainer.output_dir>/sft``)."""
    if kind == "sft":
        return Path(cfg.sft.output_dir or Path(cfg.trainer.output_dir) / "sft")
    return Path(cfg.trainer.output_dir)


def start_run(cfg: Config, kind: str) -> DistContext:
    """The entry: ``cfg`` validated and checked against the files it names (once, before any work), then
    the process group joined. (`load_config` validated what it parsed; validating here too costs nothing
    and catches edits made in code since, as the demo and the doctor make.) With standalone rollout workers
    (RL), the world's last ``rollout.workers`` ranks are theirs (``ctx.is_trainer`` is False there)."""
    cfg.validate()
    check_run_inputs(cfg, sft=kind == "sft")
    check_model_directory_here(cfg)
    if kind == "rl":
        check_engine_installed(cfg)
    t = cfg.trainer
    workers = cfg.rollout.workers if kind == "rl" and cfg.rollout.placement == "standalone" else 0
    return init_distributed(cfg.parallel, resolve_device(t.device), workers, dist_timeout_s=t.dist_timeout_s,
                            rendezvous_timeout_s=t.rendezvous_timeout_s,
                            trace_dir=run_output_dir(cfg, kind) / "nccl_traces")


def check_model_directory_here(cfg: Config) -> None:
    """The model directory must exist where the run runs (`check_run_inputs` leaves a missing one to here: a
    launcher may check where it does not); said before the decoder is chosen from a config.json not there."""
    key = "trainer.init_from" if cfg.trainer.init_from else "model.path"
    source = cfg.trainer.init_from or cfg.model.path
    if source and not Path(source).is_dir():
        raise ConfigError(f"{key}={source}: no such directory here; scalerl reads a Hugging Face model directory "
                          "(config.json, safetensors weights, tokenizer) and downloads nothing: for a Hub model, "
                          f"huggingface-cli download NAME --local-dir DIR, then {key}=DIR")


def check_engine_installed(cfg: Config) -> None:
    """``rollout.engine=vllm`` beside the trainer needs vLLM to import: checked before the output directory
    is claimed or anything is written to it (the built-in model's first weights are saved there for vLLM).
    Standalone workers import it where they run, which may be another machine."""
    if cfg.rollout.engine != "vllm" or cfg.rollout.placement != "colocated":
        return
    from scalerl.rollout.engines.vllm import import_vllm

    import_vllm()  # VLLMNotAvailable says how to install (or repair) it; imported once, the engine's later


def loads_local_shards(ctx: DistContext) -> bool:
    """Whether each rank reads only its own slices of the model directory: FSDP2 or TP without pipeline
    stages (single processes and DDP replicas hold the whole model anyway; stages are cut from it)."""
    dims = ctx.dims
    return dims.world_size > 1 and dims.pp == 1 and (dims.dp_shard > 1 or dims.tp > 1)


def fsdp_param_dtype(cfg: Config, ctx: DistContext) -> torch.dtype:
    """``trainer.fsdp_param_dtype``, refused by name on a layout FSDP2 does not shard (there, autocast is
    the way: trainer.precision=bf16)."""
    dtype = getattr(torch, cfg.trainer.fsdp_param_dtype)
    dims = ctx.dims
    sharded = dims.world_size > 1 and dims.dp > 1 and (dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1)
    if dtype != torch.float32 and not sharded:
        raise ConfigError(f"trainer.fsdp_param_dtype={cfg.trainer.fsdp_param_dtype} needs a layout FSDP2 shards "
                          f"(parallel.dp_shard > 1, or tp/pp > 1 with dp > 1); this one has dp={dims.dp}, "
                          f"dp_shard={dims.dp_shard}, tp={dims.tp}, pp={dims.pp}: use trainer.precision=bf16 "
                          "(autocast) instead")
    return dtype


class TrainingRun:
    """The scaffold a trainer subclasses (see the module's docstring). A subclass sets ``kind``, the
    exported model's folder and summary key, and defines `run_step` and `evaluate`; it lays out
    ``self.policy`` (and may add parts to ``self.trained``: their state is checkpointed, their gradient
    traffic reported)."""

    kind = ""  # "rl" | "sft": which outputs `start_run` checks, where the run writes
    export_name = ""  # the exported model's folder in the output directory
    export_key = ""  # ... and its key in `fit`'s summary
    skipped_prefix = ""  # the metric prefix `SkippedStepGuard` names
    eval_at_start = False  # evaluate before the first step (logged as step 0)

    policy: ModelParts

    @classmethod
    def from_config(cls, cfg: Config, **seams: Any) -> TrainingRun:
        """The trainer of one process that drives it itself (tests, benchmarks): `start_run`, then the
        trainer on that context."""
        return cls(cfg, start_run(cfg, cls.kind), **seams)

    def __init__(self, cfg: Config, ctx: DistContext, *, total_steps: int, eval_every: int,
                 timer: StepTimer | None = None):
        self.cfg, self.dist = cfg, ctx
        self.total_steps, self.eval_every = total_steps, eval_every
        t = cfg.trainer
        seed_everything(t.seed)
        self.device = resolve_device(t.device)
        self.output_dir = run_output_dir(cfg, self.kind)
        self.checkpoint_root = self.output_dir / CHECKPOINTS_DIR
        self._resume_from = prepare_output_dir(self.output_dir, resume=t.resume, overwrite=t.overwrite,
                                               export_dir=self.output_dir / self.export_name, ctx=ctx)
        # multi-rank: each phase's collective waits too (timing_s/comm_in/<phase>, the MFU waterfall's)
        self.timer = timer or StepTimer(self.device, ctx.comm.waited_s if ctx.world_size > 1 or ctx.rollout_ranks
                                        else None)
        self.step = 0
        self.trained: dict[str, ModelParts] = {}  # checkpoint name -> trained parts (the policy is "actor")
        self.generators: dict[str, torch.Generator] = {}  # RNG streams a checkpoint carries
        self.reshard_history: list[dict[str, Any]] = []

    # ----------------------------------------------------------------------------------------- set-up
    def load_model(self) -> nn.Module:
        """The model (``trainer.init_from``, ``model.path`` or a fresh built-in one) before it is laid out;
        sets ``tokenizer``, ``model_config`` and ``autocast``."""
        t = self.cfg.trainer
        source = t.init_from or self.cfg.model.path
        # Sharded layouts read each rank's slices once laid out (`lay_out`); the rest load the whole model.
        # (LoRA adapters are drawn on the loaded base: it is loaded whole first.)
        lora = lora_enabled(self.cfg.model.lora)
        self.weights_source = source if source and loads_local_shards(self.dist) and not lora else None
        model, self.tokenizer = load_model_and_tokenizer(self.cfg.model, t.init_from, self.device, t.seed,
                                                         on_meta=self.weights_source is not None)
        apply_lora_from_config(model, self.cfg.model.lora, t.seed)  # before any copy or layout of the policy
        self.model_config = model.config
        self.model_loaded(model)
        # trainer.precision=auto is resolved here, once, and written back: every later reader sees bf16 or fp32.
        self.precision_choice = choose_precision(t.precision, self.device, model.config, agree=self._min_over_ranks,
                                                 recompute_under_bf16=self.bf16_recompute_reason(model))
        if t.precision == "auto":
            say(self.dist, f"trainer.precision=auto: {self.precision_choice.precision} "
                           f"({self.precision_choice.reason})")
            t.precision = self.precision_choice.precision
        elif self.precision_choice.slow:
            say(self.dist, f"trainer.precision={t.precision}: {self.precision_choice.reason}")
        self.autocast = Autocast(t.precision, self.device)
        return model

    def model_loaded(self, model: nn.Module) -> None:
        """Decisions a trainer makes from the model as loaded, before the precision is chosen (RL: the engine)."""

    def bf16_recompute_reason(self, model: nn.Module) -> str | None:
        """Why a bf16 run would recompute the rollout's log-probs with fp32 generation (None: it would not,
        or there is no rollout); `trainer.precision=auto` weighs it (`choose_precision`)."""
        return None

    def _min_over_ranks(self, value: float) -> float:
        if self.dist.world_size == 1:
            return value
        return float(self.dist.all_reduce(torch.tensor([value], device=self.dist.device), op="min", over="trainer"))

    def lay_out(self, model: nn.Module, trainable: bool = True) -> ModelParts:
        """``model`` laid out for training on this run's layout (`parallelize`; ``trainable=False``: a frozen
        reference); a model still on the meta device then reads its local shards from the source."""
        cfg = self.cfg
        parts = parallelize(model, self.dist, activation_checkpointing=cfg.model.activation_checkpointing,
                            trainable=trainable, autocast=self.autocast, comm=cfg.comm,
                            pipeline=PipelineOptions(cfg.parallel.pp_schedule, cfg.parallel.microbatches),
                            param_dtype=fsdp_param_dtype(cfg, self.dist))
        if self.weights_source is not None and is_on_meta(model):
            load_local_shards(model, self.weights_source, self.device)
        return parts

    def use_optimizer(self, optimizer: torch.optim.Optimizer, scheduler: Any, grad_clip: float,
                      wrap_optimizer_step: Callable[[OptimizerStep], OptimizerStep] | None = None) -> None:
        """The optimizer and schedule (`build_optimizer`), a grad scaler for the precision, and the
        `OptimizerStep` updates call (``wrap_optimizer_step`` of it, when a harness gives one)."""
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scaler = grad_scaler(self.cfg.trainer.precision, self.device)
        self.optimizer_step = OptimizerStep(self.optimizer, self.scaler, grad_clip)
        if wrap_optimizer_step is not None:
            self.optimizer_step = wrap_optimizer_step(self.optimizer_step)

    def resume(self, must_match: list[str]) -> bool:
        """The CPU thread governor, the skipped-step guard, and the checkpoint `prepare_output_dir` chose
        loaded into the run (``must_match``: config keys it must share); True when one was."""
        t = self.cfg.trainer
        self.threads = cpu_thread_governor(t.cpu_threads, self.device)
        self.skip_guard = SkippedStepGuard(t.max_skipped_steps, self.skipped_prefix, self.checkpoint_root)
        if self._resume_from is None:
            return False
        loaded, self.reshard_history = resume_from_checkpoint(
            self._resume_from, ctx=self.dist, seed=t.seed, model=self.state_module(), optimizer=self.optimizer,
            scheduler=self.scheduler, grad_scaler=self.scaler, generators=self.generators,
            expected_config=config_to_dict(self.cfg), strict_config_keys=must_match,
        )
        self.step = loaded.step
        self.load_trainer_state(loaded.trainer_state)
        return True

    def start_logging(self) -> None:
        """The metrics logger (rank 0 writes), the health monitor; set-up traffic is not a step's."""
        t, main = self.cfg.trainer, self.dist.is_main
        self.logger = MetricsLogger(
            self.output_dir, backends=t.logger if main else [], total_steps=self.total_steps,
            config=config_to_dict(self.cfg) if main else None,
            resume_step=self.step + 1 if self._resume_from is not None else 0,  # a fresh run starts fresh files
        )
        self.monitor = HealthMonitor.for_run(t.monitor_every, self.cfg, self.dist.dims, self.device, log=main)
        self.monitor.context.update(self.precision_choice.health_context())  # compute/precision's evidence
        self.dist.comm.reset()  # set-up traffic (layouts, resume) is not a step's

    def state_module(self) -> nn.Module:
        """What a checkpoint holds on this rank: each trained part (or its pipeline stages), by name."""
        return nn.ModuleDict({name: parts.state_module() for name, parts in self.trained.items()})

    # --------------------------------------------------------------------------------------- one step
    def run_step(self) -> tuple[dict[str, float], StepWork]:
        """The trainer's own step: this rank's metrics and the work it did (for ``perf/*``)."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, combined over ranks."""
        raise NotImplementedError

    def advance(self, reduced: bool = True) -> dict[str, float]:
        """One training step and the step counter moved past it: the one seam every loop over steps uses (`fit`,
        the doctor's profiler, bench cells, benchmarks, tests). ``reduced=False``: this rank's own metrics."""
        metrics = self.train_step() if reduced else self.local_step()
        self.step += 1
        return metrics

    def train_step(self) -> dict[str, float]:
        """One step; its metrics combined over ranks."""
        return reduce_metrics(self.local_step(), self.dist)

    def local_step(self) -> dict[str, float]:
        """One step; this rank's own metrics, before they are combined over ranks."""
        step_start = time.perf_counter()
        threads = self.threads.update()
        metrics, work = self.run_step()
        metrics["perf/cpu_threads"] = float(threads)
        metrics.update(merged_comm_metrics([p.gradient_reducer for p in self.trained.values()
                                            if p.gradient_reducer is not None]))
        self.scheduler.step()
        step_time = time.perf_counter() - step_start
        metrics.update(self.timer.pop())
        metrics["timing_s/step"] = step_time
        metrics.update(self.performance_metrics(work, metrics, step_time))
        if self.dist.world_size > 1 or self.dist.rollout_ranks:  # bytes and waits since the last step's were
            metrics.update(self.dist.comm.pop())                 # read (docs/comm-accounting.md)
        metrics.update(busy_time(metrics))  # needs the waits just read
        return metrics

    def performance_metrics(self, work: StepWork, timings: dict[str, float], step_time: float) -> dict[str, float]:
        """``perf/*`` of this rank: tokens, throughput, MFU of its share per phase (``timings``: this step's
        ``timing_s/*``), peak memory."""
        tokens = work.prompt_tokens + work.response_tokens
        seconds = {"step": step_time, "gen": timings.get("timing_s/gen", 0.0),
                   "update": timings.get("timing_s/update_actor", 0.0) + timings.get("timing_s/update_critic", 0.0)}
        return {
            "perf/total_num_tokens": float(tokens),
            "perf/time_per_step": step_time,
            "perf/throughput": tokens / step_time,
            **self.mfu(work, seconds, self.dist.device),
            "perf/max_memory_gb": max_memory_gb(self.dist.device),
        }

    def mfu(self, work: StepWork, seconds: dict[str, float], device: torch.device) -> dict[str, float]:
        """`step_mfu` of this rank's share (``seconds`` keyed step, gen, update), at the run's compute dtype."""
        dtype = compute_dtype(self.cfg.trainer.precision, getattr(torch, self.cfg.model.dtype))
        dims = self.dist.dims
        return step_mfu(self.model_config, work, seconds, RankShare(dims.tp, dims.pp), device, dtype)

    # --------------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Steps until ``total_steps``, evaluating every ``eval_every`` steps and at the last, saving every
        ``trainer.save_every`` and at the last; then the model exported. Returns "initial" and "last"
        metrics and the exported model's path (under ``export_key``). SIGINT or SIGTERM stops the loop
        between steps on every rank (`StopSignals`), saving there with ``trainer.save_on_stop``, and raises
        `RunStopped` with the one line that says so."""
        save_every = self.cfg.trainer.save_every
        summary: dict[str, Any] = {}
        saved: tuple[int, Path] | None = None  # the step and checkpoint this run wrote last
        try:
            with StopSignals() as signals:
                if self.eval_at_start and self.step == 0 and self.val_rows:
                    summary["initial"] = self.evaluate()
                    self.logger.log({**summary["initial"], **self._timings()}, step=0)
                first_step = self.step
                while self.step < self.total_steps:
                    signum = signals.agreed(self.dist.world_size > 1, self.dist.group, self.dist.device)
                    if signum:
                        self.stop(signum, first_step, saved)
                    metrics = self.advance()
                    metrics.update(self.monitor.observe(self.step, metrics))
                    last = self.step == self.total_steps
                    if self.val_rows and (last or (self.eval_every and self.step % self.eval_every == 0)):
                        metrics.update(self.evaluate())
                        metrics.update(self._timings())
                    self.logger.log(metrics, step=self.step)
                    self.skip_guard.after_step(self.step, self.optimizer_step.consecutive_skips)
                    if (save_every and self.step % save_every == 0) or last:
                        with self.timer("save"):  # timing_s/save, in the next step's metrics (the MFU waterfall's)
                            saved = (self.step, self.save())
                    summary["last"] = metrics
            summary.update(self.export())
        finally:
            self.close()
        return summary

    def stop(self, signum: int, first_step: int, saved: tuple[int, Path] | None) -> None:
        """End a run asked to stop, between steps: a checkpoint of this step (unless one was just saved, or
        trainer.save_on_stop=false, or no step ran), then `RunStopped` with the line to print."""
        path, not_saved_because = None, ""
        if saved is not None and saved[0] == self.step:
            path = saved[1]
        elif self.step == first_step:
            not_saved_because = "no step ran"
        elif self.cfg.trainer.save_on_stop:
            path = self.save()
        else:
            not_saved_because = "trainer.save_on_stop=false"
        raise RunStopped(stopped_message(signum, self.step, self.total_steps, path, not_saved_because,
                                         self.checkpoint_root), signum)

    def _timings(self) -> dict[str, float]:
        """What the timer measured since the step's metrics were read (evaluation), combined over ranks."""
        timings = self.timer.pop()
        return reduce_metrics(timings, self.dist) if timings else {}

    def trainer_state(self) -> dict[str, Any]:
        """The loop's own state a checkpoint saves: the step, the data position (a subclass adds its own)."""
        return {"step": self.step, "data": self.data_state()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """`trainer_state` of a checkpoint, restored."""
        self.stream.load_state_dict(state["data"])

    def data_state(self) -> dict[str, Any]:
        """The data position a checkpoint saves."""
        return self.stream.state_dict()

    def save(self) -> Path:
        return checkpoint.save(
            self.checkpoint_root, self.step, ctx=self.dist, model=self.state_module(), optimizer=self.optimizer,
            scheduler=self.scheduler, grad_scaler=self.scaler, generators=self.generators,
            trainer_state=self.trainer_state(),
            config=config_to_dict(self.cfg), keep_last=self.cfg.trainer.keep_last,
            model_config=model_config_to_hf(self.model_config), reshard_history=self.reshard_history,
        )

    def export(self) -> dict[str, str]:
        """The policy as a Hugging Face directory (every rank takes part, rank 0 writes)."""
        t = self.cfg.trainer
        if has_lora(self.policy.model):  # the adapters alone, in PEFT's format (`scalerl export --merge` merges)
            path = save_adapter(self.policy.model, self.output_dir / self.export_name, t.init_from or self.cfg.model.path,
                                is_main=self.dist.is_main)
            if self.dist.world_size > 1:
                self.dist.barrier()
            return self.exported(path)
        path = checkpoint.export_hf_model(
            self.policy.model, self.tokenizer, self.output_dir / self.export_name, self.dist,
            dtype=export_dtype(t.export_dtype, t.init_from or self.cfg.model.path, self.cfg.model.dtype),
            max_shard_bytes=byte_size(t.export_max_shard_size))
        return self.exported(path)

    def exported(self, path: Path) -> dict[str, str]:
        """`fit`'s summary of the export: ``trained_model``, the one name both trainers use (and the CLI's
        last line), and the trainer's own older key (``export_key``)."""
        return {"trained_model": str(path), self.export_key: str(path)}

    def close(self) -> None:
        self.reward.close()  # its worker processes, with data.reward_workers
        self.logger.close()


def step_work(batch: RolloutBatch, forward_passes: int = 0, update_passes: int = 1) -> StepWork:
    """The tokens of this rank's ``batch`` and the passes a step made over them."""
    response_tokens = int(batch.response_mask.sum())
    prompt_tokens = int(batch.attention_mask.sum()) - response_tokens
    return StepWork(prompt_tokens, response_tokens, prompt_tokens / len(batch), response_tokens / len(batch),
                    forward_passes=forward_passes, update_passes=update_passes)
