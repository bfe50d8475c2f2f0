"""Supervised fine-tuning on prompt/response pairs (loss on response tokens only), used for warm starts.

Built like the RL trainer: the same layout (`parallelize`), the same update loop (`run_update`, one
mini-batch of ``sft.batch_size`` per step), checkpoints every ``trainer.save_every`` steps and
``trainer.resume=auto`` with bitwise-identical continuation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalerl import checkpoint
from scalerl.comm.gradients.reducer import merged_comm_metrics
from scalerl.comm.gradients.setup import announce
from scalerl.core.config import Config, config_to_dict
from scalerl.core.device import Autocast, compute_dtype, grad_scaler, resolve_device
from scalerl.core.rng_state import seed_everything
from scalerl.core.threads import cpu_thread_governor
from scalerl.data.prompts import encode_demonstrations
from scalerl.data.sources import PromptStream, reward_from_config, rows_from_config
from scalerl.health.monitor import HealthMonitor
from scalerl.models.hf_checkpoint import model_config_to_hf
from scalerl.models.load import load_model_and_tokenizer
from scalerl.parallel.distributed import init_distributed
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.parallel.parallelize import PipelineOptions, parallelize
from scalerl.perf.memory import max_memory_gb
from scalerl.perf.mfu import RankShare, StepWork, step_mfu
from scalerl.perf.timing import StepTimer, busy_time
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.tracking import MetricsLogger
from scalerl.trainer.evaluation import evaluate
from scalerl.trainer.layout_checks import check_sft_layout
from scalerl.trainer.objectives import SFTObjective
from scalerl.trainer.optim import build_optimizer
from scalerl.trainer.run_checks import check_run_inputs
from scalerl.trainer.run_directory import (
    CHECKPOINTS_DIR,
    prepare_output_dir,
    resume_from_checkpoint,
)
from scalerl.trainer.run_failures import SkippedStepGuard, run_reporting_failures
from scalerl.trainer.update import OptimizerStep, UpdatePlan, run_update

RESUME_MUST_MATCH = [
    "model.path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
    "model.num_key_value_heads", "model.intermediate_size", "trainer.init_from", "data.train_files",
]


def compression_warning(cfg: Config, dp_size: int) -> str | None:
    """Said at start when SFT trains a fresh model with top-k gradient compression: measured on the demo,
    it ended 16-36 points of held-out accuracy below dense where PowerSGD and bf16 did not."""
    if cfg.comm.gradient_compression != "topk" or cfg.trainer.init_from is not None or dp_size <= 1:
        return None
    return ("warning: top-k gradient compression on SFT from a freshly initialised model ended 16-36 points of "
            "held-out accuracy below dense on the demo (docs/comm-compression.md); "
            "comm.gradient_compression=powersgd or bf16 kept dense's accuracy there")


class SFTTrainer:
    def __init__(self, cfg: Config):
        cfg.validate()
        check_run_inputs(cfg, sft=True)
        self.cfg = cfg
        s, t = cfg.sft, cfg.trainer
        seed_everything(t.seed)
        self.device = resolve_device(t.device)
        self.dist = init_distributed(cfg.parallel, self.device, dist_timeout_s=t.dist_timeout_s,
                                     rendezvous_timeout_s=t.rendezvous_timeout_s,
                                     trace_dir=sft_output_dir(cfg) / "nccl_traces")
        check_sft_layout(cfg, self.dist)
        self.output_dir = sft_output_dir(cfg)
        resume_from = prepare_output_dir(self.output_dir, resume=t.resume, overwrite=t.overwrite,
                                         export_dir=self.output_dir / "model", ctx=self.dist)
        model, self.tokenizer = load_model_and_tokenizer(cfg.model, t.init_from, self.device, t.seed)
        self.model_config = model.config
        warning = compression_warning(cfg, self.dist.dp_size)
        if warning:
            announce(warning)
        self.autocast = Autocast(t.precision, self.device)
        self.policy = parallelize(
            model, self.dist, activation_checkpointing=cfg.model.activation_checkpointing, autocast=self.autocast,
            pipeline=PipelineOptions(cfg.parallel.pp_schedule, cfg.parallel.microbatches), comm=cfg.comm,
        )
        self.examples = encode_demonstrations(self.tokenizer, rows_from_config(cfg.data, "train", t.seed),
                                              cfg.data.chat_template, model.config.max_position_embeddings)
        self.val_rows = self.dist.dp_share(rows_from_config(cfg.data, "test", t.seed))
        self.stream = PromptStream(list(range(len(self.examples))), s.batch_size, t.seed, cfg.data.shuffle,
                                   batch_key="sft.batch_size")
        self.optimizer, self.scheduler = build_optimizer(
            [(self.policy.parameters(), s.lr)], s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps,
            schedule=s.lr_schedule,
        )
        self.scaler = grad_scaler(t.precision, self.device)
        self.optimizer_step = OptimizerStep(self.optimizer, self.scaler, s.grad_clip)
        self.objective = SFTObjective()
        # One optimizer step per SFT step over this rank's share, in order; pipeline stages see one shape
        # (the widest prompt and response of the data) every step.
        self.update_plan = UpdatePlan(
            epochs=1, mini_batch_size=s.batch_size // self.dist.dp_size, micro_batch_size=s.micro_batch_size,
            shuffle=False, fixed_widths=(max(len(p) for p, _ in self.examples), max(len(r) for _, r in self.examples)),
        )
        self.engine = BuiltinEngine(self.policy.model, self.tokenizer.pad_token_id, all_finished=self.dist.all_finished)
        self.reward = reward_from_config(cfg.data)
        self.threads = cpu_thread_governor(t.cpu_threads, self.device)
        self.timer = StepTimer(self.device)
        self.step = 0
        self.checkpoint_root = self.output_dir / CHECKPOINTS_DIR
        self.skip_guard = SkippedStepGuard(t.max_skipped_steps, "sft", self.checkpoint_root)
        self.reshard_history: list[dict[str, Any]] = []
        if resume_from is not None:
            loaded, self.reshard_history = resume_from_checkpoint(
                resume_from, ctx=self.dist, seed=t.seed, model=self._state_module(), optimizer=self.optimizer,
                scheduler=self.scheduler, grad_scaler=self.scaler, generators={},
                expected_config=config_to_dict(cfg), strict_config_keys=RESUME_MUST_MATCH,
            )
            self.step = loaded.step
            self.stream.load_state_dict(loaded.trainer_state["data"])
        self.logger = MetricsLogger(
            self.output_dir, backends=t.logger if self.dist.is_main else [], total_steps=s.steps,
            config=config_to_dict(cfg) if self.dist.is_main else None,
            resume_step=self.step + 1 if resume_from is not None else 0,
        )
        self.monitor = HealthMonitor.for_run(t.monitor_every, cfg, self.dist.dims, self.device, log=self.dist.is_main)
        self.dist.comm.reset()  # set-up traffic (layouts, resume) is not a step's

    def _state_module(self) -> nn.Module:
        return nn.ModuleDict({"actor": self.policy.state_module()})

    def train_step(self) -> dict[str, float]:
        """One step; its metrics combined over ranks."""
        return reduce_metrics(self.local_step(), self.dist)

    def local_step(self) -> dict[str, float]:
        """One step; this rank's own metrics, before they are combined over ranks."""
        start = time.perf_counter()
        with self.timer("data"):
            rows = self.dist.dp_share(self.stream.next_batch())  # each rank draws the global batch, keeps its part
            batch = RolloutBatch.from_demonstrations(
                [self.examples[i][0] for i in rows], [self.examples[i][1] for i in rows], self.tokenizer.pad_token_id
            ).to(self.device)
        threads = self.threads.update()
        with self.timer("update"):
            metrics = run_update(self.policy, self.optimizer_step, batch, self.objective, self.update_plan, None,
                                 self.dist, self.autocast)
        metrics["perf/cpu_threads"] = float(threads)
        update_time = self.timer.times["timing_s/update"]
        metrics["sft/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.policy.gradient_reducer is not None:
            metrics.update(merged_comm_metrics([self.policy.gradient_reducer]))
        self.scheduler.step()
        elapsed = time.perf_counter() - start
        response_tokens = int(batch.response_mask.sum())
        tokens = int(batch.attention_mask.sum())
        work = StepWork(tokens - response_tokens, response_tokens, (tokens - response_tokens) / len(batch),
                        response_tokens / len(batch))
        dims = self.dist.dims
        dtype = compute_dtype(self.cfg.trainer.precision, getattr(torch, self.cfg.model.dtype))
        mfu = step_mfu(self.model_config, work, {"update": update_time}, RankShare(dims.tp, dims.pp), self.device, dtype)
        metrics.update(self.timer.pop())
        metrics.update({
            "timing_s/step": elapsed, "perf/throughput": tokens / elapsed, "perf/mfu": mfu["perf/mfu/update"],
            "perf/max_memory_gb": max_memory_gb(self.device),
        })
        if self.dist.world_size > 1:  # bytes and waits since the last step's were read (docs/comm-accounting.md)
            metrics.update(self.dist.comm.pop())
        metrics.update(busy_time(metrics))  # needs the waits just read
        return metrics

    def evaluate(self) -> dict[str, float]:
        self.policy.refresh_generation_copy()  # a pipeline's replica reads the stages' latest weights
        self.policy.eval()
        if not self.val_rows:
            return {}
        local = evaluate(self.engine, self.tokenizer, self.val_rows, self.reward, self.cfg.rollout.max_new_tokens,
                         seed=self.cfg.trainer.seed, chat_template=self.cfg.data.chat_template)
        return reduce_metrics(local, self.dist)

    def save(self) -> Path:
        return checkpoint.save(
            self.checkpoint_root, self.step, ctx=self.dist, model=self._state_module(), optimizer=self.optimizer,
            scheduler=self.scheduler, grad_scaler=self.scaler, generators={},
            trainer_state={"step": self.step, "data": self.stream.state_dict()},
            config=config_to_dict(self.cfg), keep_last=self.cfg.trainer.keep_last,
            model_config=model_config_to_hf(self.model_config), reshard_history=self.reshard_history,
        )

    def fit(self) -> dict[str, Any]:
        s, t = self.cfg.sft, self.cfg.trainer
        summary: dict[str, Any] = {}
        with self.logger:
            while self.step < s.steps:
                metrics = self.train_step()
                self.step += 1
                metrics.update(self.monitor.observe(self.step, metrics))
                if self.step == s.steps:
                    metrics.update(self.evaluate())
                    summary["final"] = metrics
                self.logger.log(metrics, step=self.step)
                self.skip_guard.after_step(self.step, self.optimizer_step.consecutive_skips)
                if (t.save_every and self.step % t.save_every == 0) or self.step == s.steps:
                    self.save()
        self.policy.refresh_generation_copy()
        summary["model_dir"] = str(checkpoint.export_hf_model(self.policy.model, self.tokenizer,
                                                              self.output_dir / "model", self.dist))
        return summary


def sft_output_dir(cfg: Config) -> Path:
    return Path(cfg.sft.output_dir or Path(cfg.trainer.output_dir) / "sft")


def train_sft(cfg: Config) -> dict[str, Any]:
    """Run SFT as configured by the ``sft`` section (model/data/trainer sections as for RL)."""
    return run_reporting_failures(lambda: SFTTrainer(cfg).fit(), sft_output_dir(cfg) / CHECKPOINTS_DIR)
