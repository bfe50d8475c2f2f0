"""Checks made before any work, each failing with a message that names the keys.

Before the process group is joined, what a config names outside itself (`check_run_inputs`): the model
directory's shape against the layout and the sequence lengths, its tokenizer, the reward function, and the
output directories. `Config.validate` checks the config alone (and the built-in model, whose shape is in
the config); these read the files it points at. The run's entry (`scalerl.trainer.run.start_run`), the
launchers before they start ranks, the demo and `scalerl config` call it, so a bad path or an impossible
layout fails in a second instead of after the model has loaded or the job has queued. A model directory
that does not exist here is left to the trainer (a launcher may run where it does exist); nothing is
created or written.

Once the group is joined, what each trainer needs from the parallel layout (`check_rl_layout`,
`check_sft_layout`): batch sizes that split over data-parallel ranks and pipeline micro-batches, and
features that do not run distributed yet.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scalerl.core.algorithm_names import needs_critic
from scalerl.core.config import (
    BUILTIN_REWARDS,
    ConfigError,
    sequence_parallel_head_problems,
)

if TYPE_CHECKING:  # the layout checks' argument; importing it pulls in torch, which `scalerl config` does not need
    from scalerl.parallel.distributed import DistContext


def check_run_inputs(cfg: Any, sft: bool | None = None, import_reward: bool = True) -> None:
    """Everything below for the run `cfg` describes; `sft` = True/False checks only that trainer's outputs,
    None both; `import_reward` imports a user reward function (launchers skip it: it may exist only where
    the ranks run). Raises a UserError (ConfigError, CheckpointFormatError, TokenizerError,
    RewardFunctionError) naming the key."""
    resolve_init_from(cfg)
    specs = ",".join(s for s in cfg.data.reward.split(",") if s.strip() != "judge")  # the judge: data.judge.model
    if import_reward and specs and specs not in BUILTIN_REWARDS:
        from scalerl.data.rewards.computer import load_reward_fns

        load_reward_fns(specs, cfg.data.task)  # runs the modules' imports, as the run would
    problems = model_directory_problems(cfg)
    if sft is not False and cfg.sft.output_dir:
        problems += output_dir_problems(cfg.sft.output_dir, "sft.output_dir")
    if sft is not True or not cfg.sft.output_dir:
        problems += output_dir_problems(cfg.trainer.output_dir, "trainer.output_dir")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"invalid config ({len(problems)} problems):\n  " + "\n  ".join(problems))


# Where a run's output directory holds its trained model: RL's export, SFT's export, SFT's under an RL directory.
TRAINED_MODEL_DIRS = ("final", "model", "sft/model")


def resolve_init_from(cfg: Any) -> None:
    """``trainer.init_from`` given as a run's output directory (`scalerl sft`'s, as the README writes it)
    becomes the trained model inside it, said once; a directory with no model in it or below it is refused,
    naming the paths looked at."""
    source = cfg.trainer.init_from
    if not source or not Path(source).is_dir() or _holds_model(Path(source)):
        return
    found = [Path(source) / name for name in TRAINED_MODEL_DIRS if _holds_model(Path(source) / name)]
    if len(found) == 1:
        cfg.trainer.init_from = str(found[0])
        if os.environ.get("RANK", "0") == "0":  # stderr: `scalerl config` keeps stdout for the YAML
            print(f"trainer.init_from={source}: the trained model in it, {found[0]}", file=sys.stderr, flush=True)
        return
    looked = ", ".join(str(Path(source) / name) for name in TRAINED_MODEL_DIRS)
    if found:
        raise ConfigError(f"trainer.init_from={source} holds several trained models ({', '.join(map(str, found))}); "
                          "name the one to start from")
    raise ConfigError(f"trainer.init_from={source} holds no model: no config.json in it, nor in {looked} (where "
                      "scalerl train and scalerl sft export theirs); give the model directory itself")


def _holds_model(directory: Path) -> bool:
    return (directory / "config.json").is_file() or (directory / "adapter_config.json").is_file()


def model_directory_problems(cfg: Any) -> list[str]:
    """The model directory's config.json against `parallel.tp/pp` and the prompt + response length; its
    tokenizer must be there unless `model.tokenizer` names one (raised by `tokenizer_source`)."""
    key = "trainer.init_from" if cfg.trainer.init_from else "model.path"
    source = cfg.trainer.init_from or cfg.model.path
    if not source or not Path(source).is_dir():
        return []
    # Imported here: they pull in torch, which `scalerl config` on the built-in model does not need.
    from scalerl.models.load import model_architecture, tokenizer_source
    from scalerl.models.transformers_model import (
        TransformersModelConfig,
        transformers_layout_problems,
    )

    model = model_architecture(cfg.model, source)
    tokenizer_source(cfg.model, source, key)
    problems = []
    if isinstance(model, TransformersModelConfig):
        problems += transformers_layout_problems(cfg.parallel, model.model_type)
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(model, attr) % cfg.parallel.tp:
            problems.append(f"parallel.tp={cfg.parallel.tp} does not divide {attr}={getattr(model, attr)} of "
                            f"{key}={source}: tensor parallelism splits it evenly over the tp ranks")
    problems += sequence_parallel_head_problems(cfg.parallel.sp, model.num_attention_heads, model.num_key_value_heads,
                                                f"{key}={source}'s ")
    if model.num_hidden_layers % cfg.parallel.pp:
        problems.append(f"parallel.pp={cfg.parallel.pp} does not divide num_hidden_layers={model.num_hidden_layers} "
                        f"of {key}={source}: each pipeline stage holds the same number of layers")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if longest > model.max_position_embeddings:
        problems.append(f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length} + "
                        f"{cfg.rollout.max_new_tokens} = {longest} exceeds max_position_embeddings="
                        f"{model.max_position_embeddings} of {key}={source}")
    return problems


def output_dir_problems(path: str, key: str) -> list[str]:
    """Why `path` cannot become an output directory: a file is in the way, or the nearest existing folder
    is not writable. Creates nothing."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        return [f"{key}={path!r} is a file, not a directory; choose another {key}"]
    existing = target.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return [f"{key}={path!r} cannot be created: {existing} is a file; choose another {key}"]
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(existing) else "no write permission"
        return [f"{key}={path!r} cannot be written: {existing} is not writable ({reason}); choose another {key}"]
    return []


def _read_only(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError as e:
        return e.errno == errno.EROFS


def _divides(problems: list[str], key: str, value: int, dp: int) -> None:
    if value % dp:
        problems.append(f"{key} ({value}) must be divisible by the data-parallel size {dp}")


def _pipeline_problems(problems: list[str], cfg: Any, ctx: DistContext, key: str, per_rank: int) -> None:
    dims = ctx.dims
    if dims.pp > 1 and dims.tp > 1 and dims.dp > 1:
        problems.append(f"pipeline parallel combines with data parallel or tensor parallel, not both yet "
                        f"(pp={dims.pp}, dp={dims.dp}, tp={dims.tp})")
    if dims.pp > 1 and per_rank % cfg.parallel.microbatches:
        problems.append(f"parallel.microbatches ({cfg.parallel.microbatches}) must divide the per-rank "
                        f"mini-batch {key} / dp = {per_rank}")


def check_rl_layout(cfg: Any, ctx: DistContext) -> None:
    """What the RL trainer needs from the layout; raises a LayoutError naming every problem (a ConfigError
    for rollout.stream_groups with a pipeline)."""
    if cfg.rollout.stream_groups and ctx.dims.pp > 1:
        # The streamed passes run on trimmed micro-batches as rows arrive; pipeline stages run one fixed shape.
        raise ConfigError(f"rollout.stream_groups=true does not run with parallel.pp={ctx.dims.pp}: the pipeline "
                          "schedule runs one fixed micro-batch shape over the whole batch; set "
                          "rollout.stream_groups=false or parallel.pp=1")
    if ctx.world_size == 1:
        return
    dp, problems = ctx.dp_size, []
    _divides(problems, "trainer.batch_size", cfg.trainer.batch_size, dp)
    _divides(problems, "actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size, dp)
    _pipeline_problems(problems, cfg, ctx, "actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size // dp)
    if ctx.dims.pp > 1 and cfg.actor.micro_batch_max_tokens:
        problems.append("actor.micro_batch_max_tokens (dynamic batch size) does not apply with parallel.pp > 1")
    if ctx.dims.pp > 1 and needs_critic(cfg.algorithm.adv_estimator):
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (a critic) does not run with "
                        "parallel.pp > 1 yet")
    if cfg.rollout.engine == "vllm" and cfg.rollout.placement == "colocated":
        problems.append("rollout.engine=vllm colocated runs on one trainer rank only for now (standalone rollout "
                        "workers each run an engine: rollout.placement=standalone)")
    _raise_layout_problems(problems)


def check_sft_layout(cfg: Any, ctx: DistContext) -> None:
    """What the SFT trainer needs from the layout; raises a LayoutError naming every problem."""
    if ctx.world_size == 1:
        return
    dp, problems = ctx.dp_size, []
    _divides(problems, "sft.batch_size", cfg.sft.batch_size, dp)
    _pipeline_problems(problems, cfg, ctx, "sft.batch_size", cfg.sft.batch_size // dp)
    _raise_layout_problems(problems)


def _raise_layout_problems(problems: list[str]) -> None:
    from scalerl.parallel.mesh import LayoutError

    if problems:
        raise LayoutError("; ".join(problems))
