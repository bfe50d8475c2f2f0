"""Run configuration: scalerl's dataclass sections, loaded from YAML with `key.sub=value` overrides.

One `Config` describes a whole run. It is built as `defaults <- YAML file <- overrides` (later wins) and
checked completely before any work starts, so a typo fails in a second instead of after model loading:

    cfg = load_config("run.yaml", ["actor.lr=1e-6", "rollout.n=8"])

Every error is a `ConfigError` naming the full dotted key (`actor.lr must be > 0, got -1.0`). The generic
machinery (YAML, overrides, type checks) is `scalerl.core.config_tree`; this module is the schema.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl.core import config_tree
from scalerl.core.config_tree import (  # re-exported: `scalerl.core.config` is the public config API
    ConfigError,
    Section as _Section,
    _check,
    _check_choice,
    apply_override,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    format_config,
    opt,
    save_config,
    split_config_args,
)

__all__ = [
    "ActorSection", "AlgorithmSection", "CommSection", "Config", "ConfigError", "CriticSection", "DataSection", "ModelSection",
    "ParallelSection", "RolloutSection", "SFTSection", "TrainerSection", "apply_override", "config_from_dict",
    "config_to_dict", "config_to_yaml", "describe_keys", "format_config", "load_config", "opt", "save_config",
    "split_config_args",
]

# --------------------------------------------------------------------------------------------- schema

DTYPES = ("float32", "bfloat16", "float16")
TASKS = ("arithmetic", "gsm8k", "math")
ROLLOUT_ENGINES = ("builtin", "vllm")
LR_SCHEDULES = ("constant", "cosine")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
ADV_ESTIMATORS = ("grpo", "gae")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
BUILTIN_REWARDS = ("auto", "gsm8k", "math")


@dataclass
class ModelSection(_Section):
    name = "model"
    path: str | None = opt(None, "Hugging Face model directory; null = the built-in tiny model")
    tokenizer: str | None = opt(None, "tokenizer directory; null = model path ('builtin' chars for the built-in model)")
    hidden_size: int = opt(128, "built-in model: hidden size")
    num_hidden_layers: int = opt(2, "built-in model: decoder layers")
    num_attention_heads: int = opt(4, "built-in model: query heads")
    num_key_value_heads: int = opt(2, "built-in model: key/value heads (grouped-query attention)")
    intermediate_size: int = opt(352, "built-in model: MLP width")
    dtype: str = opt("float32", "parameter dtype: " + " | ".join(DTYPES))
    activation_checkpointing: bool = opt(False, "recompute layer activations in backward to save memory")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, self._key("dtype"), self.dtype, DTYPES)
        if self.path is not None:
            return p  # the architecture fields below only describe the built-in model
        for attr in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size"):
            _check(p, getattr(self, attr) >= 1, self._key(attr), ">= 1", getattr(self, attr))
        if p:
            return p
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            p.append(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                     f"model.num_attention_heads ({heads})")
        elif (self.hidden_size // heads) % 2:
            # rotary embeddings rotate pairs of channels, so each head needs an even width
            p.append(f"model.hidden_size / model.num_attention_heads = {self.hidden_size // heads} "
                     "must be even (rotary embeddings rotate channel pairs)")
        if heads % kv_heads:
            p.append(f"model.num_attention_heads ({heads}) must be divisible by "
                     f"model.num_key_value_heads ({kv_heads})")
        return p


@dataclass
class DataSection(_Section):
    name = "data"
    task: str = opt("arithmetic", "built-in task: " + " | ".join(TASKS))
    train_files: list[str] = opt(help="training prompt files (parquet/jsonl); empty = generate/download", factory=list)
    val_files: list[str] = opt(help="validation prompt files", factory=list)
    prompt_template: str | None = opt(None, "format string for the prompt; null = the task's default")
    difficulty: list[int] = opt(help="arithmetic task: difficulty levels to sample", factory=lambda: [1, 2])
    num_train: int = opt(4000, "generated tasks: number of training prompts")
    num_val: int = opt(200, "generated tasks: number of validation prompts")
    max_prompt_length: int = opt(64, "longest prompt in tokens; a longer one stops the run with an error naming it")
    chat_template: bool = opt(False, "send each prompt as a user message through the tokenizer's chat template")
    reward: str = opt("auto", "auto (by task) | gsm8k | math | module:function | file.py:function")
    shuffle: bool = opt(True, "shuffle training prompts every epoch")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "data.task", self.task, TASKS)
        _check(p, len(self.difficulty) >= 1 and all(d >= 1 for d in self.difficulty), "data.difficulty",
               "a non-empty list of levels >= 1", self.difficulty)
        _check(p, self.num_train >= 1, "data.num_train", ">= 1", self.num_train)
        _check(p, self.num_val >= 0, "data.num_val", ">= 0", self.num_val)
        _check(p, self.max_prompt_length >= 1, "data.max_prompt_length", ">= 1", self.max_prompt_length)
        if self.reward not in BUILTIN_REWARDS and ":" not in self.reward:
            p.append(f"data.reward must be one of {', '.join(BUILTIN_REWARDS)}, 'module:function' or "
                     f"'file.py:function'; got {self.reward!r}")
        return p


@dataclass
class RolloutSection(_Section):
    name = "rollout"
    engine: str = opt("builtin", "generation engine: " + " | ".join(ROLLOUT_ENGINES))
    n: int = opt(8, "samples per prompt (the GRPO group size)")
    temperature: float = opt(1.0, "sampling temperature for training rollouts")
    top_p: float = opt(1.0, "nucleus sampling mass, 0 < top_p <= 1")
    top_k: int = opt(0, "keep the k most likely tokens; 0 = off")
    max_new_tokens: int = opt(16, "response length limit in tokens")
    val_temperature: float = opt(0.0, "sampling temperature for evaluation; 0 = greedy")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "rollout.engine", self.engine, ROLLOUT_ENGINES)
        _check(p, self.n >= 1, "rollout.n", ">= 1", self.n)
        _check(p, self.temperature >= 0, "rollout.temperature", ">= 0", self.temperature)
        _check(p, 0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(p, self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)
        _check(p, self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(p, self.val_temperature >= 0, "rollout.val_temperature", ">= 0", self.val_temperature)
        return p


def _check_optimizer(p: list[str], prefix: str, lr: float, weight_decay: float, warmup_steps: int,
                     lr_schedule: str, grad_clip: float) -> None:
    """Checks shared by the actor and SFT optimizer settings."""
    _check(p, lr > 0, f"{prefix}.lr", "> 0", lr)
    _check(p, weight_decay >= 0, f"{prefix}.weight_decay", ">= 0", weight_decay)
    _check(p, warmup_steps >= 0, f"{prefix}.warmup_steps", ">= 0", warmup_steps)
    _check_choice(p, f"{prefix}.lr_schedule", lr_schedule, LR_SCHEDULES)
    _check(p, grad_clip >= 0, f"{prefix}.grad_clip", ">= 0 (0 = off)", grad_clip)


@dataclass
class ActorSection(_Section):
    name = "actor"
    lr: float = opt(1e-4, "peak learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    betas: list[float] = opt(help="AdamW betas [beta1, beta2]", factory=lambda: [0.9, 0.999])
    warmup_steps: int = opt(0, "linear warmup steps (optimizer steps)")
    lr_schedule: str = opt("constant", "after warmup: " + " | ".join(LR_SCHEDULES))
    min_lr_ratio: float = opt(0.0, "cosine schedule floor as a fraction of lr")
    grad_clip: float = opt(1.0, "max gradient norm; 0 = off")
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    ppo_mini_batch_size: int = opt(64, "sequences per optimizer step")
    ppo_micro_batch_size: int = opt(16, "sequences per forward/backward (gradient accumulation)")
    micro_batch_max_tokens: int = opt(
        0, "dynamic batch size: pack micro-batches up to this many (padded) tokens; 0 = fixed ppo_micro_batch_size"
    )
    clip_ratio_low: float = opt(0.2, "PPO clip: ratio >= 1 - clip_ratio_low")
    clip_ratio_high: float = opt(0.2, "PPO clip: ratio <= 1 + clip_ratio_high")
    clip_ratio_c: float = opt(3.0, "dual-clip bound for negative advantages (> 1)")
    loss_agg_mode: str = opt("token-mean", "loss aggregation: " + " | ".join(LOSS_AGG_MODES))
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = opt(False, "add a KL penalty to a frozen reference model to the loss")
    kl_loss_coef: float = opt(0.001, "KL penalty coefficient")
    kl_loss_type: str = opt("low_var_kl", " | ".join(KL_LOSS_TYPES) + "; a trailing '+' uses the straight-through form")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_optimizer(p, "actor", self.lr, self.weight_decay, self.warmup_steps, self.lr_schedule, self.grad_clip)
        _check(p, len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "actor.betas",
               "two values in [0, 1)", self.betas)
        _check(p, 0 <= self.min_lr_ratio <= 1, "actor.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        _check(p, self.ppo_epochs >= 1, "actor.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(p, self.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", ">= 1", self.ppo_mini_batch_size)
        _check(p, self.ppo_micro_batch_size >= 1, "actor.ppo_micro_batch_size", ">= 1", self.ppo_micro_batch_size)
        _check(p, self.clip_ratio_low >= 0, "actor.clip_ratio_low", ">= 0", self.clip_ratio_low)
        _check(p, self.clip_ratio_high >= 0, "actor.clip_ratio_high", ">= 0", self.clip_ratio_high)
        # dual clip bounds the loss of negative-advantage tokens from below; <= 1 would cut into the PPO clip
        _check(p, self.clip_ratio_c > 1, "actor.clip_ratio_c", "> 1", self.clip_ratio_c)
        _check_choice(p, "actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check(p, self.kl_loss_coef >= 0, "actor.kl_loss_coef", ">= 0", self.kl_loss_coef)
        if self.kl_loss_type.removesuffix("+") not in KL_LOSS_TYPES:
            p.append(f"actor.kl_loss_type must be one of {', '.join(KL_LOSS_TYPES)} (optionally with a "
                     f"trailing '+'); got {self.kl_loss_type!r}")
        if not p and self.ppo_mini_batch_size % self.ppo_micro_batch_size:
            p.append(f"actor.ppo_micro_batch_size ({self.ppo_micro_batch_size}) must divide "
                     f"actor.ppo_mini_batch_size ({self.ppo_mini_batch_size})")
        return p


@dataclass
class CriticSection(_Section):
    """Value model settings; used when algorithm.adv_estimator == "gae"."""

    name = "critic"
    lr: float = opt(1e-4, "critic learning rate")
    cliprange_value: float = opt(0.5, "value clipping range around the old values")
    value_loss_coef: float = opt(0.5, "value loss weight")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.lr > 0, "critic.lr", "> 0", self.lr)
        _check(p, self.cliprange_value >= 0, "critic.cliprange_value", ">= 0", self.cliprange_value)
        _check(p, self.value_loss_coef >= 0, "critic.value_loss_coef", ">= 0", self.value_loss_coef)
        return p


@dataclass
class AlgorithmSection(_Section):
    name = "algorithm"
    adv_estimator: str = opt("grpo", "advantage estimator: grpo (group-normalized) | gae (PPO with a critic)")
    norm_adv_by_std_in_grpo: bool = opt(True, "GRPO: divide by the group's reward std (false = Dr. GRPO)")
    gamma: float = opt(1.0, "GAE discount")
    lam: float = opt(1.0, "GAE lambda")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        _check(p, 0 <= self.gamma <= 1, "algorithm.gamma", "in [0, 1]", self.gamma)
        _check(p, 0 <= self.lam <= 1, "algorithm.lam", "in [0, 1]", self.lam)
        return p


@dataclass
class SFTSection(_Section):
    name = "sft"
    steps: int = opt(300, "optimizer steps")
    lr: float = opt(1e-3, "peak learning rate")
    batch_size: int = opt(64, "sequences per optimizer step")
    micro_batch_size: int = opt(64, "sequences per forward/backward (gradient accumulation)")
    warmup_steps: int = opt(10, "linear warmup steps")
    lr_schedule: str = opt("cosine", "after warmup: " + " | ".join(LR_SCHEDULES))
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm; 0 = off")
    output_dir: str | None = opt(None, "where the SFT model is saved; null = <trainer.output_dir>/sft")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_optimizer(p, "sft", self.lr, self.weight_decay, self.warmup_steps, self.lr_schedule, self.grad_clip)
        _check(p, self.steps >= 1, "sft.steps", ">= 1", self.steps)
        _check(p, self.batch_size >= 1, "sft.batch_size", ">= 1", self.batch_size)
        _check(p, self.micro_batch_size >= 1, "sft.micro_batch_size", ">= 1", self.micro_batch_size)
        if not p and self.batch_size % self.micro_batch_size:
            p.append(f"sft.micro_batch_size ({self.micro_batch_size}) must divide sft.batch_size ({self.batch_size})")
        return p


@dataclass
class TrainerSection(_Section):
    name = "trainer"
    total_steps: int = opt(20, "training steps (one rollout batch each)")
    batch_size: int = opt(16, "prompts per step")
    seed: int = opt(0, "random seed")
    output_dir: str = opt("outputs/run", "checkpoints, metrics and the resolved config go here")
    save_every: int = opt(0, "checkpoint every N steps; 0 = only at the end")
    keep_last: int = opt(2, "checkpoints kept on disk")
    resume: str = opt("never", "auto (latest in output_dir) | never | <checkpoint dir>")
    eval_every: int = opt(5, "evaluate every N steps; 0 = only before and after training")
    logger: list[str] = opt(help="metric sinks: " + " | ".join(LOGGERS), factory=lambda: ["console", "jsonl"])
    precision: str = opt("fp32", "autocast precision: fp32 | bf16 | fp16 (fp16 uses a grad scaler)")
    device: str = opt("auto", "auto | cpu | cuda")
    init_from: str | None = opt(None, "model directory to start from (e.g. the SFT output)")
    balance_batch: bool = opt(True, "redistribute rollouts over DP ranks so each gets a near-equal token count")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.total_steps >= 0, "trainer.total_steps", ">= 0", self.total_steps)
        _check(p, self.batch_size >= 1, "trainer.batch_size", ">= 1", self.batch_size)
        _check(p, self.save_every >= 0, "trainer.save_every", ">= 0 (0 = only at the end)", self.save_every)
        _check(p, self.keep_last >= 1, "trainer.keep_last", ">= 1", self.keep_last)
        _check(p, self.resume != "", "trainer.resume", "auto, never or a checkpoint directory", self.resume)
        _check(p, self.eval_every >= 0, "trainer.eval_every", ">= 0 (0 = only before and after)", self.eval_every)
        for i, logger in enumerate(self.logger):
            _check_choice(p, f"trainer.logger[{i}]", logger, LOGGERS)
        _check_choice(p, "trainer.precision", self.precision, PRECISIONS)
        _check_choice(p, "trainer.device", self.device, DEVICES)
        return p


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class ParallelSection(_Section):
    name = "parallel"
    dp_replicate: int = opt(-1, "data-parallel replicas (DDP, or HSDP's replicate dim); -1 = all ranks left over")
    dp_shard: int = opt(1, "FSDP2 shard group size (>1 turns on FSDP; with dp_replicate>1, HSDP); -1 = left over")
    tp: int = opt(1, "tensor-parallel degree (heads and kv heads must divide by it)")
    pp: int = opt(1, "pipeline-parallel stages (layers must divide by it)")
    pp_schedule: str = opt("1f1b", "pipeline schedule: " + " | ".join(PP_SCHEDULES))
    microbatches: int = opt(4, "pipeline micro-batches per mini-batch")

    def problems(self) -> list[str]:
        p: list[str] = []
        for key in ("dp_replicate", "dp_shard", "tp", "pp"):
            value = getattr(self, key)
            _check(p, value == -1 or value >= 1, f"parallel.{key}", ">= 1 or -1 (fill the world)", value)
        if self.dp_replicate == -1 and self.dp_shard == -1:
            p.append("only one of parallel.dp_replicate and parallel.dp_shard may be -1")
        _check(p, self.tp != -1 and self.pp != -1, "parallel.tp/pp", "explicit sizes (>= 1)", (self.tp, self.pp))
        _check_choice(p, "parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check(p, self.microbatches >= 1, "parallel.microbatches", ">= 1", self.microbatches)
        return p


ALLREDUCE_KINDS = ("auto", "flat", "hierarchical")
GRADIENT_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")
# Compressions that need DDP's per-bucket hooks; FSDP reduce-scatters shards and has no such hook.
HOOK_ONLY_COMPRESSIONS = ("powersgd", "topk")


@dataclass
class CommSection(_Section):
    """How data-parallel gradients are reduced (DDP comm hooks; see docs/comm-compression.md)."""

    name = "comm"
    allreduce: str = opt("auto", "gradient all-reduce: auto (hierarchical when the inter-node link is much slower "
                                 "than intra-node, else flat) | flat | hierarchical (intra-node reduce-scatter, "
                                 "inter-node all-reduce, intra-node all-gather)")
    inter_node_mbit: float = opt(0.0, "inter-node link rate in Mbit/s for comm.allreduce=auto when sysfs cannot tell "
                                      "(virtual or shaped links); 0 = read it from the topology")
    gradient_compression: str = opt("none", "DDP gradient compression: " + " | ".join(GRADIENT_COMPRESSIONS) +
                                    "; powersgd and topk keep an error-feedback residual")
    layer_adaptive: bool = opt(True, "powersgd/topk: per-tensor rank/density chosen from measured gradient "
                                     "statistics under comm.compression_budget (else comm.topk_density / "
                                     "comm.powersgd_rank for every tensor)")
    compression_budget: float = opt(0.1, "layer-adaptive: bytes each rank contributes per reduction, as a fraction "
                                         "of the dense fp32 gradient's bytes (0.1 = 90% fewer)")
    topk_density: float = opt(0.01, "topk without layer_adaptive: fraction of each tensor's elements sent")
    topk_momentum: float = opt(0.0, "topk: Deep Gradient Compression momentum correction factor (momentum "
                                    "accumulated before sparsification); 0 = plain error feedback, which suits "
                                    "AdamW (it keeps its own moments)")
    powersgd_rank: int = opt(4, "powersgd without layer_adaptive: rank of every matrix's approximation")
    compression_start_step: int = opt(10, "powersgd/topk: optimizer steps of dense all-reduce before compressing "
                                          "(warm-up; layer-adaptive measures its statistics there, so it "
                                          "takes at least 1)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "comm.allreduce", self.allreduce, ALLREDUCE_KINDS)
        _check(p, self.inter_node_mbit >= 0, "comm.inter_node_mbit", ">= 0 (0 = detect)", self.inter_node_mbit)
        _check_choice(p, "comm.gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
        _check(p, 0 < self.compression_budget <= 1, "comm.compression_budget", "in (0, 1]", self.compression_budget)
        _check(p, 0 < self.topk_density <= 1, "comm.topk_density", "in (0, 1]", self.topk_density)
        _check(p, 0 <= self.topk_momentum < 1, "comm.topk_momentum", "in [0, 1)", self.topk_momentum)
        _check(p, self.powersgd_rank >= 1, "comm.powersgd_rank", ">= 1", self.powersgd_rank)
        _check(p, self.compression_start_step >= 0, "comm.compression_start_step", ">= 0",
               self.compression_start_step)
        return p


@dataclass
class Config(_Section):
    """A whole run: every section, each with defaults."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    actor: ActorSection = field(default_factory=ActorSection)
    critic: CriticSection = field(default_factory=CriticSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    sft: SFTSection = field(default_factory=SFTSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    comm: CommSection = field(default_factory=CommSection)

    def problems(self) -> list[str]:
        p = [msg for f in dataclasses.fields(self) for msg in getattr(self, f.name).problems()]
        if p:
            return p  # cross-section checks assume each section is sane
        rollouts = self.trainer.batch_size * self.rollout.n
        if rollouts % self.actor.ppo_mini_batch_size:
            p.append(f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size}) must divide "
                     f"trainer.batch_size * rollout.n = {self.trainer.batch_size} * {self.rollout.n} = {rollouts}")
        if self.algorithm.adv_estimator == "grpo" and self.rollout.n < 2:
            # a group of one has zero spread, so every GRPO advantage would be 0 and nothing would learn
            p.append(f"rollout.n must be >= 2 when algorithm.adv_estimator is 'grpo', got {self.rollout.n}")
        p += _comm_layout_problems(self.comm, self.parallel)
        return p



def _comm_layout_problems(comm: CommSection, par: ParallelSection) -> list[str]:
    """PowerSGD and top-k run in DDP comm hooks: a layout that shards or splits the model (FSDP2 reduce-
    scatters DTensor shards) has none. fp16/bf16 still apply there, as FSDP's reduce dtype."""
    if comm.gradient_compression not in HOOK_ONLY_COMPRESSIONS:
        return []
    sharded = [f"parallel.{k}={getattr(par, k)}" for k in ("dp_shard", "tp", "pp") if getattr(par, k) not in (1,)]
    if not sharded:
        return []
    return [f"comm.gradient_compression={comm.gradient_compression} needs plain data parallelism (DDP), but "
            f"{', '.join(sharded)} lays the model out with FSDP2, which has no per-bucket comm hook; use "
            "comm.gradient_compression=bf16 or fp16 (applied as FSDP's reduce dtype) or none"]


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), cls: type = Config) -> Any:
    """Defaults <- YAML file at `path` (if any) <- `overrides` in order; then validate everything.

    Raises FileNotFoundError for a missing file and ConfigError for anything else wrong.
    """
    return config_tree.load_config(path, overrides, cls)


def describe_keys(cls: type = Config, prefix: str = "") -> str:
    """Every key of the schema with its type, default and help (`scalerl config --keys`)."""
    return config_tree.describe_keys(cls, prefix)
