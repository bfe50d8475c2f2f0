"""The `trainer` section (the run: steps, seed, outputs, checkpoints, resume, evaluation, logging,
precision and device, export) and `sft` (the SFT trainer's own steps and optimizer)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from scalerl.core.config.actor import LR_SCHEDULES, check_optimizer
from scalerl.core.config.model import DTYPES
from scalerl.core.config.tree import Section, _check, _check_choice, opt

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainerSection(Section):
    name = "trainer"
    total_steps: int = opt(20, "training steps (one rollout batch each)")
    batch_size: int = opt(16, "prompts per step")
    seed: int = opt(0, "random seed")
    output_dir: str = opt("outputs/run", "checkpoints, metrics and the resolved config go here")
    save_every: int = opt(0, "checkpoint every N steps; 0 = only at the end")
    keep_last: int = opt(2, "checkpoints kept on disk")
    save_on_stop: bool = opt(True, "on Ctrl-C or SIGTERM (a scheduler's time limit) the run stops after the "
                             "current step; true: it saves a checkpoint there (trainer.resume=auto continues "
                             "from it); false: only if trainer.save_every falls due")
    resume: str = opt("never", "auto (latest in output_dir) | never | <checkpoint dir>; never refuses an "
                      "output_dir holding another run's outputs unless trainer.overwrite=true")
    overwrite: bool = opt(False, "with resume=never, delete another run's outputs (checkpoints/, metrics.jsonl, "
                          "final/, model/, tensorboard/) found in output_dir instead of refusing to start")
    eval_every: int = opt(5, "evaluate every N steps; 0 = only before and after training")
    logger: list[str] = opt(help="metric sinks: " + " | ".join(LOGGERS), factory=lambda: ["console", "jsonl"])
    precision: str = opt("fp32", "autocast precision: fp32 | bf16 | fp16 (fp16 uses a grad scaler) | auto (bf16 "
                         "on a CUDA device with bf16, or on a CPU with bf16 instructions where a probe of the "
                         "model's MLP matmul at start measures bf16 at least 1.5x fp32 and the engine decodes in bf16 without an "
                         "old-log-prob recompute; else fp32; said at start)")
    device: str = opt("auto", "auto | cpu | cuda")
    init_from: str | None = opt(None, "model directory to start from (e.g. the SFT output)")
    balance_batch: bool = opt(True, "redistribute rollouts over DP ranks so each gets a near-equal token count")
    cpu_threads: int = opt(0, "CPU only: torch threads; 0 = follow the cores other processes leave free, "
                              "re-checked during the run")
    max_skipped_steps: int = opt(5, "stop the run after this many optimizer steps in a row were skipped for a "
                                 "non-finite gradient norm, naming the last good checkpoint; 0 = never stop")
    dist_timeout_s: float = opt(600.0, "distributed runs: limit for one collective (a frozen or lost rank ends "
                                "the run with an error naming the collective and the silent ranks)", above=0)
    rendezvous_timeout_s: float = opt(120.0, "distributed runs: limit for joining the process group at "
                                      "MASTER_ADDR:MASTER_PORT (an unreachable master or a missing rank)", above=0)
    val_n: int = opt(1, "evaluation samples per prompt at rollout.val_temperature; > 1 adds val/pass@n, "
                     "val/mean@n, val/maj@n (and per data source) to the greedy val/accuracy", at_least=1)
    monitor_every: int = opt(10, "online health monitor: every N steps run scalerl doctor's rules on the step "
                                 "metrics (one warning with its fix per crossing; health/* levels to the metric "
                                 "sinks); 0 = off")
    fsdp_param_dtype: str = opt("float32", "layouts FSDP2 shards (parallel.dp_shard > 1, or tp/pp > 1 with dp > 1): "
                                "the dtype parameters are gathered and computed in; bfloat16 keeps float32 master weights (the "
                                "optimizer steps them) and reduces gradients in float32, as FSDP2's "
                                "MixedPrecisionPolicy: " + " | ".join(DTYPES))
    export_dtype: str = opt("source", "the exported model's dtype: source (the torch_dtype in config.json of "
                            "trainer.init_from / model.path; model.dtype for the built-in model) | "
                            + " | ".join(DTYPES))
    export_max_shard_size: str = opt("5GB", "largest safetensors file of the exported model, as transformers' "
                                     "max_shard_size (5GB, 500MB, 2GiB): a bigger model is written as shards "
                                     "listed in model.safetensors.index.json")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.total_steps >= 0, "trainer.total_steps", ">= 0", self.total_steps)
        if not self.output_dir.strip():
            # an empty path means the current directory: outputs would land among the user's own files
            p.append("trainer.output_dir is empty: give a directory for checkpoints and metrics, e.g. outputs/run")
        _check(p, self.max_skipped_steps >= 0, "trainer.max_skipped_steps", ">= 0 (0 = never stop)",
               self.max_skipped_steps)
        _check(p, self.batch_size >= 1, "trainer.batch_size", ">= 1", self.batch_size)
        _check(p, self.save_every >= 0, "trainer.save_every", ">= 0 (0 = only at the end)", self.save_every)
        _check(p, self.keep_last >= 1, "trainer.keep_last", ">= 1", self.keep_last)
        _check(p, self.resume != "", "trainer.resume", "auto, never or a checkpoint directory", self.resume)
        _check(p, self.eval_every >= 0, "trainer.eval_every", ">= 0 (0 = only before and after)", self.eval_every)
        for i, logger in enumerate(self.logger):
            _check_choice(p, f"trainer.logger[{i}]", logger, LOGGERS)
        _check_choice(p, "trainer.precision", self.precision, PRECISIONS)
        _check_choice(p, "trainer.device", self.device, DEVICES)
        _check(p, self.cpu_threads >= 0, "trainer.cpu_threads", ">= 0 (0 = follow the free cores)", self.cpu_threads)
        _check(p, self.monitor_every >= 0, "trainer.monitor_every", ">= 0 (0 = off)", self.monitor_every)
        _check_choice(p, "trainer.fsdp_param_dtype", self.fsdp_param_dtype, DTYPES)
        _check_choice(p, "trainer.export_dtype", self.export_dtype, ("source", *DTYPES))
        try:
            byte_size(self.export_max_shard_size)
        except ValueError as err:
            p.append(f"trainer.export_max_shard_size: {err}")
        return p


_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(text: str | int) -> int:
    """``"5GB"`` -> 5e9, ``"2GiB"`` -> 2 * 2**30, ``"500MB"``, a plain number of bytes (transformers'
    ``max_shard_size`` spelling); at least one byte."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _BYTE_UNITS or float(match.group(1)) * _BYTE_UNITS[unit] < 1:
        raise ValueError(f"{text!r} is not a size: write a number with a unit, e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


@dataclass
class SFTSection(Section):
    name = "sft"
    steps: int = opt(300, "optimizer steps")
    lr: float = opt(1e-3, "peak learning rate", above=0)
    batch_size: int = opt(64, "sequences per optimizer step")
    micro_batch_size: int = opt(64, "sequences per forward/backward (gradient accumulation)")
    warmup_steps: int = opt(10, "linear warmup steps")
    lr_schedule: str = opt("cosine", "after warmup: " + " | ".join(LR_SCHEDULES))
    weight_decay: float = opt(0.0, "AdamW weight decay", at_least=0)
    grad_clip: float = opt(1.0, "max gradient norm; 0 = off", at_least=0)
    output_dir: str | None = opt(None, "where the SFT model is saved; null = <trainer.output_dir>/sft")

    def problems(self) -> list[str]:
        p: list[str] = []
        check_optimizer(p, "sft", self.warmup_steps, self.lr_schedule)
        if self.output_dir is not None and not self.output_dir.strip():
            p.append("sft.output_dir is empty: give a directory, or null for <trainer.output_dir>/sft")
        _check(p, self.steps >= 1, "sft.steps", ">= 1", self.steps)
        _check(p, self.batch_size >= 1, "sft.batch_size", ">= 1", self.batch_size)
        _check(p, self.micro_batch_size >= 1, "sft.micro_batch_size", ">= 1", self.micro_batch_size)
        if not p and self.batch_size % self.micro_batch_size:
            p.append(f"sft.micro_batch_size ({self.micro_batch_size}) must divide sft.batch_size ({self.batch_size})")
        return p
