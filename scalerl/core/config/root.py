"""The whole run's `Config`: every section, the checks that read more than one section, and loading (defaults
<- YAML file <- overrides, then every check) and the key listing (`scalerl config --keys`).

Each section's own keys and checks live in the module named for it (`model`, `data`, `rollout`, `actor`,
`algorithm`, `trainer`, `parallel`, `comm`); a check that needs two sections is here, so a section module
never imports another section's config to check itself and the cross-section rules are read in one place.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl.core.algorithm_names import needs_greedy_baseline, needs_groups
from scalerl.core.config.actor import ActorSection, CriticSection
from scalerl.core.config.algorithm import AlgorithmSection
from scalerl.core.config.comm import HOOK_ONLY_COMPRESSIONS, CommSection, WeightSyncSection
from scalerl.core.config.data import DataSection
from scalerl.core.config.model import BUILTIN_MAX_POSITIONS, ModelSection
from scalerl.core.config.parallel import ParallelSection, sequence_parallel_head_problems
from scalerl.core.config.rollout import RolloutSection
from scalerl.core.config.trainer import SFTSection, TrainerSection
from scalerl.core.config.tree import Section
from scalerl.core.config.tree import describe_keys as describe_tree_keys
from scalerl.core.config.tree import load_config as load_tree


@dataclass
class Config(Section):
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
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    comm: CommSection = field(default_factory=CommSection)

    def problems(self) -> list[str]:
        p = [msg for f in dataclasses.fields(self) for msg in getattr(self, f.name).all_problems()]
        if p:
            return p  # cross-section checks assume each section is sane
        rollouts = self.trainer.batch_size * self.rollout.n
        if rollouts % self.actor.ppo_mini_batch_size:
            p.append(f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size}) must divide "
                     f"trainer.batch_size * rollout.n = {self.trainer.batch_size} * {self.rollout.n} = {rollouts}")
        estimator = self.algorithm.adv_estimator
        if needs_groups(estimator) and self.rollout.n < 2:
            # a group of one has no other sample to compare with, so every advantage would be 0 (or baseline-free)
            p.append(f"rollout.n must be >= 2 when algorithm.adv_estimator is {estimator!r} (it compares the "
                     f"samples of a prompt), got {self.rollout.n}")
        if (needs_groups(estimator) or needs_greedy_baseline(estimator)) and self.rollout.temperature == 0:
            # greedy decoding gives a prompt's samples (and remax's greedy baseline) the same text and reward
            p.append(f"rollout.temperature=0 (greedy) makes the rollout.n samples of a prompt identical, so every "
                     f"advantage of algorithm.adv_estimator={estimator} is 0 and nothing trains; use rollout.temperature > 0 "
                     "(e.g. 1.0)")
        p += _shaping_problems(self)
        if self.model.path is None and self.trainer.init_from is None:
            p += builtin_model_problems(self)
        p += _comm_layout_problems(self.comm, self.parallel)
        if self.parallel.ep > 1 and (self.model.path is None and self.trainer.init_from is None):
            p.append(f"parallel.ep={self.parallel.ep} shards a MoE model's experts; the built-in model is dense: set "
                     "model.path to a qwen2_moe / qwen3_moe directory or parallel.ep=1")
        if self.rollout.agent.env and self.rollout.placement == "colocated" and (
                self.parallel.dp_shard > 1 or self.parallel.tp > 1):
            p.append(f"rollout.agent.env={self.rollout.agent.env} decodes its episodes by continuous batching, which "
                     f"needs whole weights: with parallel.dp_shard={self.parallel.dp_shard}, parallel.tp="
                     f"{self.parallel.tp} set rollout.placement=standalone (the workers hold whole copies; the "
                     "trainer keeps its layout) or parallel.dp_shard=1 and parallel.tp=1")
        if self.rollout.agent.env and self.rollout.placement == "standalone" and self.data.num_val > 0 and (
                self.parallel.dp_shard > 1 or self.parallel.tp > 1):
            p.append(f"rollout.agent.env={self.rollout.agent.env} evaluates in episodes on the trainer's engine, which "
                     f"needs whole weights; with parallel.dp_shard={self.parallel.dp_shard}, parallel.tp="
                     f"{self.parallel.tp} the trainer's are sharded: set data.num_val=0 (no evaluation during the "
                     "run; evaluate the saved model afterwards) or parallel.dp_shard=1 and parallel.tp=1")
        if self.parallel.ep > 1 and self.rollout.placement == "standalone":
            p.append(f"parallel.ep={self.parallel.ep} with rollout.placement=standalone: weight pushes to rollout "
                     "workers do not gather the sharded experts yet; use rollout.placement=colocated")
        if self.rollout.staleness > 1 and self.algorithm.filter_groups.enable:
            p.append(f"rollout.staleness={self.rollout.staleness} with algorithm.filter_groups.enable=true: dynamic "
                     "sampling's further rounds would draw prompts between steps already sent ahead, so a resumed "
                     "run could not draw the same; use rollout.staleness <= 1 with dynamic sampling")
        p += _lora_problems(self)
        p += _sequence_parallel_problems(self)
        p += _router_replay_problems(self)
        return p


def _router_replay_problems(cfg: Config) -> list[str]:
    """actor.router_replay on what records and replays routes: the built-in engine's fixed batch, colocated,
    over unsplit layers (a dense model is refused at trainer start, where the model is known)."""
    r, par = cfg.rollout, cfg.parallel
    if not cfg.actor.router_replay:
        return []
    p = [f"actor.router_replay=true with parallel.{key}={getattr(par, key)}: routing replay runs with data "
         f"parallelism only (parallel.dp_replicate / dp_shard); set parallel.{key}=1 or actor.router_replay=false"
         for key in ("tp", "pp", "sp", "ep") if getattr(par, key) > 1]
    if r.engine == "vllm":
        p.append("actor.router_replay=true with rollout.engine=vllm: scalerl's vLLM engine does not ask vLLM for the "
                 "experts it routed to (recent vLLM has enable_return_routed_experts; not wired in), so there is "
                 "nothing to replay; set rollout.engine=builtin or actor.router_replay=false")
    if r.placement != "colocated" or r.agent.env or r.max_num_seqs:
        p.append(f"actor.router_replay=true records routes in the built-in engine's fixed colocated batch only (got "
                 f"rollout.placement={r.placement}, rollout.max_num_seqs={r.max_num_seqs}, rollout.agent.env="
                 f"{r.agent.env or 'none'}); set rollout.placement=colocated, rollout.max_num_seqs=0 and no "
                 "rollout.agent.env, or actor.router_replay=false")
    return p


def _sequence_parallel_problems(cfg: Config) -> list[str]:
    """Ulysses composes with DP / FSDP2 (and packing); other layouts and the paths it does not split are refused."""
    par = cfg.parallel
    if par.sp == 1:
        return []
    p = [f"parallel.sp={par.sp} with parallel.{key}={getattr(par, key)}: sequence parallelism runs with data "
         f"parallelism only (parallel.dp_replicate / dp_shard); set parallel.{key}=1 or parallel.sp=1"
         for key in ("tp", "pp", "ep") if getattr(par, key) > 1]
    if cfg.model.implementation == "transformers":
        p.append(f"parallel.sp={par.sp} with model.implementation=transformers: the all-to-all hooks scalerl's own "
                 "attention; use model.implementation=scalerl (or auto) or parallel.sp=1")
    if cfg.rollout.placement == "standalone":
        p.append(f"parallel.sp={par.sp} with rollout.placement=standalone is not supported; use "
                 "rollout.placement=colocated or parallel.sp=1")
    return p


def _lora_problems(cfg: Config) -> list[str]:
    """LoRA on the layouts and implementations it is tested on: DDP / FSDP2 over scalerl's decoder."""
    lora, par = cfg.model.lora, cfg.parallel
    if lora.rank == 0:
        return []
    p = []
    for key in ("tp", "pp", "ep"):
        if getattr(par, key) > 1:
            p.append(f"model.lora.rank={lora.rank} with parallel.{key}={getattr(par, key)}: LoRA adapters are "
                     "trained under DDP and FSDP2 only (parallel.dp_replicate / dp_shard); set parallel."
                     f"{key}=1 or model.lora.rank=0")
    if cfg.model.implementation == "transformers":
        p.append(f"model.lora.rank={lora.rank} with model.implementation=transformers: adapters wrap scalerl's own "
                 "decoder; use model.implementation=scalerl (or auto, for the architectures scalerl implements)")
    return p


def builtin_model_problems(cfg: Config) -> list[str]:
    """The built-in model's shape (the `model` section) against the layout and the sequence lengths; a model
    directory's own config.json is checked the same way once it is read (`scalerl.trainer.run_checks`)."""
    m, par, p = cfg.model, cfg.parallel, []
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(m, attr) % par.tp:
            p.append(f"parallel.tp={par.tp} does not divide model.{attr}={getattr(m, attr)}: tensor parallelism "
                     "splits it evenly over the tp ranks")
    p += sequence_parallel_head_problems(par.sp, m.num_attention_heads, m.num_key_value_heads, "model.")
    if m.num_hidden_layers % par.pp:
        p.append(f"parallel.pp={par.pp} does not divide model.num_hidden_layers={m.num_hidden_layers}: each "
                 "pipeline stage holds the same number of layers")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if longest > BUILTIN_MAX_POSITIONS:
        p.append(f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length} + "
                 f"{cfg.rollout.max_new_tokens} = {longest} exceeds the built-in model's {BUILTIN_MAX_POSITIONS} "
                 "positions")
    return p


def _shaping_problems(cfg: Config) -> list[str]:
    """The overlong buffer within the response limit; sampled evaluation that samples."""
    p, buffer, limit = [], cfg.algorithm.overlong_buffer, cfg.rollout.max_new_tokens
    if buffer.enable and not 0 < buffer.len <= limit:
        p.append(f"algorithm.overlong_buffer.len must be in (0, rollout.max_new_tokens={limit}] with "
                 f"algorithm.overlong_buffer.enable=true, got {buffer.len}")
    if cfg.trainer.val_n > 1 and cfg.rollout.val_temperature == 0:
        p.append(f"trainer.val_n={cfg.trainer.val_n} samples per prompt at rollout.val_temperature=0 (greedy) are "
                 "all the same response; set rollout.val_temperature > 0 (e.g. 1.0) or trainer.val_n=1")
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
    return load_tree(path, overrides, cls)


def describe_keys(cls: type = Config, prefix: str = "") -> str:
    """Every key of the schema with its type, default and help (`scalerl config --keys`)."""
    return describe_tree_keys(cls, prefix)
