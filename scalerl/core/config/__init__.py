"""Run configuration: scalerl's dataclass sections, loaded from YAML with `key.sub=value` overrides.

One `Config` describes a whole run. It is built as `defaults <- YAML file <- overrides` (later wins) and
checked completely before any work starts, so a typo fails in a second instead of after model loading:

    cfg = load_config("run.yaml", ["actor.lr=1e-6", "rollout.n=8"])

Every error is a `ConfigError` naming the full dotted key (`actor.lr must be > 0, got -1.0`). This package
is imported by its name alone (`from scalerl.core.config import Config, load_config`); inside it:

- `tree`: the generic machinery (YAML, overrides, type checks, the key listing), `numbers`: the bounds every
  number is checked against;
- one module per section, its keys, choices and own checks: `model` (model, model.lora), `data` (data),
  `reward_models` (data.reward_model, data.judge), `rollout` (rollout, rollout.agent), `actor` (actor,
  critic), `algorithm` (algorithm and its subsections), `trainer` (trainer, sft), `parallel` (parallel),
  `comm` (comm, weight_sync);
- `root`: `Config`, the checks that read more than one section, `load_config` and `describe_keys`.

Section modules import `tree` and each other's choice lists, never `root`.
"""

from __future__ import annotations

from scalerl.core.config.actor import (
    KL_LOSS_TYPES,
    LOSS_AGG_MODES,
    LR_SCHEDULES,
    POLICY_LOSSES,
    ActorSection,
    CriticSection,
)
from scalerl.core.config.algorithm import (
    ADV_ESTIMATORS,
    FILTER_GROUPS_METRICS,
    KL_CONTROLLER_TYPES,
    AlgorithmSection,
    DistillSection,
    FilterGroupsSection,
    KLControlSection,
    OverlongBufferSection,
)
from scalerl.core.config.comm import (
    ALLREDUCE_KINDS,
    GRADIENT_COMPRESSIONS,
    HOOK_ONLY_COMPRESSIONS,
    WEIGHT_SYNC_MODES,
    CommSection,
    WeightSyncSection,
)
from scalerl.core.config.data import BUILTIN_REWARDS, DATA_FORMATS, TASKS, DataSection
from scalerl.core.config.model import (
    BUILTIN_MAX_POSITIONS,
    BUILTIN_VOCAB_SIZE,
    DTYPES,
    MODEL_IMPLEMENTATIONS,
    LoraSection,
    ModelSection,
)
from scalerl.core.config.parallel import PP_SCHEDULES, ParallelSection, sequence_parallel_head_problems
from scalerl.core.config.reward_models import (
    DEFAULT_JUDGE_TEMPLATE,
    JUDGE_SLOTS,
    JUDGE_VERDICTS,
    JudgeSection,
    RewardModelSection,
    judge_template_problems,
    parse_judge_labels,
)
from scalerl.core.config.rollout import (
    GREEDY_BELOW_TEMPERATURE,
    IS_LEVELS,
    IS_MODES,
    ROLLOUT_DTYPES,
    ROLLOUT_ENGINES,
    ROLLOUT_PLACEMENTS,
    STALE_LOGPROBS,
    AgentSection,
    RolloutSection,
)
from scalerl.core.config.root import Config, builtin_model_problems, describe_keys, load_config
from scalerl.core.config.trainer import DEVICES, LOGGERS, PRECISIONS, SFTSection, TrainerSection, byte_size
from scalerl.core.config.tree import (
    ConfigError,
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
    # the whole run, loading and writing
    "Config", "ConfigError", "apply_override", "config_from_dict", "config_to_dict", "config_to_yaml",
    "describe_keys", "format_config", "load_config", "opt", "save_config", "split_config_args",
    # sections
    "ActorSection", "AgentSection", "AlgorithmSection", "CommSection", "CriticSection", "DataSection",
    "DistillSection", "FilterGroupsSection", "JudgeSection", "KLControlSection", "LoraSection", "ModelSection",
    "OverlongBufferSection", "ParallelSection", "RewardModelSection", "RolloutSection", "SFTSection",
    "TrainerSection", "WeightSyncSection",
    # checks and parsers the runtime shares
    "builtin_model_problems", "byte_size", "judge_template_problems", "parse_judge_labels",
    "sequence_parallel_head_problems",
    # choices and limits
    "ADV_ESTIMATORS", "ALLREDUCE_KINDS", "BUILTIN_MAX_POSITIONS", "BUILTIN_REWARDS", "BUILTIN_VOCAB_SIZE",
    "DATA_FORMATS", "DEFAULT_JUDGE_TEMPLATE", "DEVICES", "DTYPES", "FILTER_GROUPS_METRICS",
    "GRADIENT_COMPRESSIONS", "GREEDY_BELOW_TEMPERATURE", "HOOK_ONLY_COMPRESSIONS", "IS_LEVELS", "IS_MODES",
    "JUDGE_SLOTS", "JUDGE_VERDICTS", "KL_CONTROLLER_TYPES", "KL_LOSS_TYPES", "LOGGERS", "LOSS_AGG_MODES",
    "LR_SCHEDULES", "MODEL_IMPLEMENTATIONS", "POLICY_LOSSES", "PP_SCHEDULES", "PRECISIONS", "ROLLOUT_DTYPES",
    "ROLLOUT_ENGINES", "ROLLOUT_PLACEMENTS", "STALE_LOGPROBS", "TASKS", "WEIGHT_SYNC_MODES",
]
