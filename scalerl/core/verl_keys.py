"""verl's keys, as data: for each its default (verl's `_generated_ppo_trainer.yaml`, v0.9), the scalerl key it
sets and how the value changes on the way (`VERL_KEYS`), and verl's engine and memory tuning that has no
counterpart here, with the reason (`NO_EFFECT`, patterns). Extending `--from-verl` is adding a row here;
`verl_overrides.py` reads the table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalerl.core.config.tree import ConfigError

NO_DEFAULT = object()  # the key only counts when the command line gives it
Verl = dict[str, Any]  # the verl run's values by dotted key: its defaults <- the command line


@dataclass(frozen=True)
class VerlKey:
    """One verl key: `target` is the scalerl key set from `transform(value, verl)` (None: nothing set).

    `inert` is the value that changes nothing here; any other value of a key with no target is an error.
    `only_if(verl)` false: verl itself ignores the key in this run (e.g. kl_ctrl without use_kl_in_reward).
    `read_by`: the key sets nothing itself, but that key's transform reads it (the table shows whose target
    it feeds)."""

    verl: str
    default: Any
    target: str | None
    note: str = ""
    transform: Callable[[Any, Verl], Any] | None = None
    inert: Any = NO_DEFAULT
    only_if: Callable[[Verl], bool] | None = None
    read_by: str | None = None  # the verl key whose translation reads this one (the table names its target)
    also: tuple[tuple[str, Callable[[Any, Verl], Any]], ...] = ()  # further (scalerl key, transform) set with target


A, R, OPT = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.actor.optim."
SHARED_WITH_ACTOR = "scalerl trains the critic with the actor's optimiser and schedule: only the actor's value is accepted"
SCALERL_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
ENGINES = {"vllm": "vllm", "sglang": "vllm", "trtllm": "vllm", "hf": "builtin"}


def _samples_per_mini_batch(value: int, verl: Verl) -> int:
    # verl counts prompts per mini-batch and multiplies by rollout.n; scalerl counts sequences (global)
    return int(value) * int(verl[R + "n"])


def _lora(verl: Verl) -> bool:
    return int(verl["actor_rollout_ref.model.lora_rank"]) > 0  # verl reads its LoRA settings only then


def _top_k(value: int, verl: Verl) -> int:
    return max(int(value), 0)  # verl's -1 = off is scalerl's 0


def _freq(value: int, verl: Verl) -> int:
    return max(int(value), 0)  # verl's -1 = never during training; scalerl's 0 = only at the end


def _val_temperature(value: float, verl: Verl) -> float:
    return float(value) if verl[R + "val_kwargs.do_sample"] else 0.0  # verl: do_sample=false is greedy


def _loggers(value: Any, verl: Verl) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    # jsonl is scalerl's own metrics file (read by `scalerl doctor`); loggers with no sink here are dropped
    return [n for n in names if n in SCALERL_LOGGERS] + ([] if "jsonl" in names else ["jsonl"])


def _output_dir(value: Any, verl: Verl) -> str:
    if value is not None:
        return str(value)
    return f"checkpoints/{verl['trainer.project_name']}/{verl['trainer.experiment_name']}"  # verl's default


def _resume(value: str, verl: Verl) -> str:
    if value == "resume_path":
        return str(verl["trainer.resume_from_path"])
    if value not in ("auto", "disable"):
        raise ConfigError(f"trainer.resume_mode={value!r}: expected auto | disable | resume_path")
    return "never" if value == "disable" else "auto"


def _engine(value: str, verl: Verl) -> str:
    if value not in ENGINES:
        raise ConfigError(f"{R}name={value!r}: no such rollout engine here; scalerl runs builtin | vllm "
                          f"(verl's {' | '.join(ENGINES)} are translated)")
    return ENGINES[value]


def _reward(value: Any, verl: Verl) -> str:
    return f"{value}:{verl['custom_reward_function.name']}"


def _uses_reward_model(verl: Verl) -> bool:
    return bool(verl["reward_model.enable"])


def _reward_model_only(value: Any, verl: Verl) -> str:
    if "reward_model.model.path" not in verl:
        raise ConfigError("reward_model.enable=true needs reward_model.model.path (the reward model's checkpoint)")
    return "none"  # verl's reward manager returns the model's scores as they are


def _total_steps(value: Any, verl: Verl) -> int:
    if verl["trainer.total_training_steps"] is not None:
        return int(verl["trainer.total_training_steps"])  # verl: it wins over total_epochs
    files = verl.get("data.train_files", NO_DEFAULT)
    if files is NO_DEFAULT:
        raise ConfigError("trainer.total_epochs needs data.train_files (verl: steps = rows // train_batch_size "
                          "x epochs); give data.train_files or trainer.total_training_steps")
    rows = sum(count_rows(f) for f in _file_list(files))
    per_epoch = rows // int(verl["data.train_batch_size"])  # verl's train dataloader drops the last batch
    if per_epoch < 1:
        raise ConfigError(f"data.train_files hold {rows} rows, fewer than data.train_batch_size="
                          f"{verl['data.train_batch_size']}: verl would train 0 steps")
    return per_epoch * int(value)


def _warmup_steps(steps: int, verl: Verl) -> int:
    ratio = float(verl[OPT + "lr_warmup_steps_ratio"])
    if steps >= 0 or ratio == 0:
        return max(steps, 0)
    return int(ratio * _total_steps(verl["trainer.total_epochs"], verl))  # verl: int(ratio x total steps)


def _file_list(value: Any) -> list[str]:
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _policy_loss_key(name: str) -> VerlKey:
    return VerlKey(A + "policy_loss." + name, NO_DEFAULT, "actor." + name)


D = "distillation."


def _distills(verl: Verl) -> bool:
    return bool(verl["distillation.enabled"])


def _teacher_path(value: Any, verl: Verl) -> str:
    if not value:
        raise ConfigError("--from-verl: distillation.enabled=true needs the teacher's model directory: "
                          "distillation.teacher_models.teacher_model.model_path=<dir>")
    return str(value)


# verl 0.9.1's several teachers: `distillation.teacher_models.<entry>.{key, model_path, ...}`, each entry routing the
# rows whose `distillation.teacher_key` field (data_source) equals its key; the default entry `teacher_model` is
# the single teacher (its key ignored, every row routed to it) and verl drops it once other entries are named
# (verl/workers/config/distillation.py, `DistillationConfig._resolve_teacher_models`).
_TEACHER_ENTRY = re.compile(r"distillation\.teacher_models\.([^.]+)\.(.+)")
_TEACHER_ENTRY_NO_EFFECT = {"num_replicas": "the teacher's serving",
                            "inference": "the teacher's inference engine: here its forward pass"}


def _named_teacher_entry(key: str) -> tuple[str, str] | None:
    """(entry name, field) of a `distillation.teacher_models.<entry>.<field>` key other than the default entry's."""
    match = _TEACHER_ENTRY.fullmatch(key)
    return (match.group(1), match.group(2)) if match and match.group(1) != "teacher_model" else None


def is_teacher_entry_key(key: str) -> bool:
    """A key of a named teacher entry (`distillation.teacher_models.<entry>.*`, entry not `teacher_model`):
    translated by `teacher_entries_translation`, not by the table."""
    return _named_teacher_entry(key) is not None


def _several_teachers(verl: Verl) -> bool:
    return _distills(verl) and any(is_teacher_entry_key(k) for k in verl)


def _single_teacher(verl: Verl) -> bool:
    return _distills(verl) and not _several_teachers(verl)


def teacher_entries_translation(verl: Verl, given: Verl) -> tuple[list[tuple[str, Any, str]], dict[str, Any]]:
    """The table rows and scalerl values of verl's named teacher entries (``given``: the command line's keys,
    ``verl``: with verl's defaults): ``algorithm.distill.teachers`` = {entry key: entry model_path}. As verl,
    an entry without key or model_path and two entries with one key are errors; the default entry's
    model_path given beside named entries is an error here (verl drops it silently)."""
    entries: dict[str, dict[str, tuple[str, Any]]] = {}
    for key, value in given.items():
        named = _named_teacher_entry(key)
        if named:
            entries.setdefault(named[0], {})[named[1]] = (key, value)
    if not entries:
        return [], {}
    if not _distills(verl):
        return [(key, value, "no effect here: distillation.enabled=false") for fields in entries.values()
                for key, value in fields.values()], {}
    if given.get(D + "teacher_models.teacher_model.model_path"):
        raise ConfigError(f"--from-verl: {D}teacher_models.teacher_model.model_path is given beside named teachers "
                          f"({', '.join(sorted(entries))}): verl drops the teacher_model entry then, so that teacher "
                          "would silently teach nothing: give it its own entry name and key "
                          f"(+{D}teacher_models.teacher_model1.key=<data_source> "
                          f"+{D}teacher_models.teacher_model1.model_path=<dir>)")
    rows: list[tuple[str, Any, str]] = []
    teachers: dict[str, str] = {}
    for name, fields in entries.items():
        for field, (key, value) in fields.items():
            if field not in ("key", "model_path") and field.split(".")[0] not in _TEACHER_ENTRY_NO_EFFECT:
                raise ConfigError(f"--from-verl: '{key}' is not a field of verl's teacher entries (key, model_path, "
                                  "num_replicas, inference.*)")
        source, path = (fields.get(f, (None, None))[1] for f in ("key", "model_path"))
        if source in (None, "") or path in (None, ""):
            missing = " and ".join(f for f, v in (("key", source), ("model_path", path)) if v in (None, ""))
            raise ConfigError(f"--from-verl: {D}teacher_models.{name} has no {missing}: each teacher needs "
                              f"+{D}teacher_models.{name}.key=<the data_source it teaches> and "
                              f"+{D}teacher_models.{name}.model_path=<dir> (verl refuses it too)")
        if str(source) in teachers:
            raise ConfigError(f"--from-verl: two teacher entries have key {source!r} (verl refuses it too): give each "
                              "data source one teacher")
        teachers[str(source)] = str(path)
        for field, (key, value) in fields.items():
            head = field.split(".")[0]
            rows.append((key, value, f"algorithm.distill.teachers.{source}" if field == "model_path" else
                         "algorithm.distill.teachers (the data source this entry teaches)" if field == "key" else
                         f"no effect here: {_TEACHER_ENTRY_NO_EFFECT[head]}"))
    return rows, {"algorithm.distill.teachers": teachers}


def _topk_mode(verl: Verl) -> bool:
    return _distills(verl) and verl[D + "distillation_loss.loss_mode"] == "forward_kl_topk"


def _distill_estimator(value: Any, verl: Verl) -> str:
    if value == "forward_kl_topk":  # a loss term here (algorithm.distill.top_k); the estimator is unused
        if verl[D + "distillation_loss.use_policy_gradient"]:
            raise ConfigError("--from-verl: distillation.distillation_loss.loss_mode=forward_kl_topk with "
                              "use_policy_gradient=true: verl then trains only the sampled token's log-prob; scalerl "
                              "implements forward_kl_topk as the supervised loss verl recommends: set "
                              "distillation.distillation_loss.use_policy_gradient=false")
        return "k1"
    if not verl[D + "distillation_loss.use_policy_gradient"]:
        raise ConfigError(f"--from-verl: distillation.distillation_loss.loss_mode={value} with use_policy_gradient="
                          "false (verl's default) backpropagates the KL estimate itself; scalerl trains the per-token "
                          "estimators as a reward (use_policy_gradient=true) and the supervised form only for "
                          "loss_mode=forward_kl_topk: set one of the two")
    return str(value)


M, AG, AGENT = R + "multi_turn.", R + "agent.", "rollout.agent."


def _agent_route(verl: Verl) -> bool:
    """verl runs agent loops here: its own loops (agent_loop_config_path) or its tool loop over a tool config, a
    @function_tool file or interactions."""
    return any(verl[key] is not None for key in (AG + "agent_loop_config_path", M + "tool_config_path",
                                                 M + "function_tool_path", M + "interaction_config_path"))


def _agent_env(value: Any, verl: Verl) -> str:
    if not _agent_route(verl):
        raise ConfigError(f"--from-verl: {M}enable=true with neither {M}tool_config_path nor "
                          f"{AG}agent_loop_config_path (nor function_tool_path, interaction_config_path): give the "
                          "tools (a tool config YAML, a @function_tool file), the interactions or the agent loops "
                          "to run")
    # the user's loops run as they are (env=verl); verl's ToolAgentLoop over a tool config is scalerl's tool
    # environment over the same tools (env=tools), which needs no verl installed
    return "verl" if verl[AG + "agent_loop_config_path"] is not None else "tools"


def _response_length(verl: Verl) -> int:
    return int(verl.get(R + "response_length", verl["data.max_response_length"]))


def _trajectory_budget(value: Any, verl: Verl) -> int:
    # verl's prompt_length + response_length: the response holds every turn and every tool answer
    return int(verl.get(R + "prompt_length", verl["data.max_prompt_length"])) + _response_length(verl)


def _max_turns(value: Any, verl: Verl) -> int:
    # verl ends a turn loop at max_assistant_turns, or after max_user_turns tool/user answers (one more turn);
    # with neither, only the response budget ends it (each turn is at least one token)
    limits = [int(value)] if value else []
    if verl[M + "max_user_turns"]:
        limits.append(int(verl[M + "max_user_turns"]) + 1)
    return min(limits) if limits else _response_length(verl)


def _uses_kl_in_reward(verl: Verl) -> bool:
    return bool(verl["algorithm.use_kl_in_reward"])


VERL_KEYS: tuple[VerlKey, ...] = (
    # data
    VerlKey("data.train_files", NO_DEFAULT, "data.train_files", transform=lambda v, _: _file_list(v)),
    VerlKey("data.val_files", NO_DEFAULT, "data.val_files", transform=lambda v, _: _file_list(v)),
    VerlKey("data.train_batch_size", 1024, "trainer.batch_size", "prompts per step, as in verl"),
    VerlKey("data.max_prompt_length", 512, "data.max_prompt_length"),
    VerlKey("data.max_response_length", 512, "rollout.max_new_tokens"),
    VerlKey("data.prompt_key", "prompt", "data.prompt_key"),
    VerlKey("data.reward_fn_key", "data_source", "data.reward_fn_key"),
    VerlKey("data.shuffle", True, "data.shuffle"),
    VerlKey("data.seed", NO_DEFAULT, "trainer.seed"),
    VerlKey("data.tokenizer", NO_DEFAULT, "model.tokenizer"),
    VerlKey("data.filter_overlong_prompts", False, None, "scalerl drops no prompt: one longer than "
            "data.max_prompt_length stops the run with an error naming it (the run never trains on other data)"),
    VerlKey("data.truncation", "error", None, "with filter_overlong_prompts no prompt is truncated; here a prompt "
            "over data.max_prompt_length is an error", inert="error",
            only_if=lambda verl: not verl["data.filter_overlong_prompts"]),
    VerlKey("data.train_max_samples", -1, None, inert=-1),
    VerlKey("data.custom_cls.path", None, None, inert=None),
    VerlKey("data.apply_chat_template_kwargs", {}, None, inert={}),
    # model
    VerlKey("actor_rollout_ref.model.path", NO_DEFAULT, "model.path"),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", False, "model.activation_checkpointing"),
    VerlKey("actor_rollout_ref.model.lora_rank", 0, "model.lora.rank", "LoRA adapters (docs/models.md#lora)"),
    VerlKey("actor_rollout_ref.model.lora.rank", 0, None, "verl's newer spelling: give lora_rank", inert=0),
    VerlKey("actor_rollout_ref.model.lora_alpha", 16, "model.lora.alpha", only_if=_lora),
    VerlKey("actor_rollout_ref.model.target_modules", "all-linear", "model.lora.target_modules",
            "PEFT's names, all-linear too", transform=lambda v, verl: [v] if isinstance(v, str) else list(v),
            only_if=_lora),
    VerlKey("actor_rollout_ref.model.exclude_modules", None, None, "no exclusions here: list the targets instead",
            inert=None, only_if=_lora),
    # actor optimiser (verl steps its schedule once per training step, as scalerl does)
    VerlKey(OPT + "lr", 1e-6, "actor.lr"),
    VerlKey(OPT + "weight_decay", 0.01, "actor.weight_decay"),
    VerlKey(OPT + "betas", [0.9, 0.999], "actor.betas"),
    VerlKey(OPT + "clip_grad", 1.0, "actor.grad_clip"),
    VerlKey(A + "grad_clip", NO_DEFAULT, "actor.grad_clip", "verl's older name of optim.clip_grad"),
    VerlKey(OPT + "lr_warmup_steps", -1, "actor.warmup_steps", "-1: from lr_warmup_steps_ratio",
            transform=lambda v, verl: _warmup_steps(int(v), verl)),
    VerlKey(OPT + "lr_warmup_steps_ratio", 0.0, None, "read by lr_warmup_steps (x total steps)",
            only_if=lambda verl: False, read_by=OPT + "lr_warmup_steps"),
    VerlKey(OPT + "lr_scheduler_type", "constant", "actor.lr_schedule"),
    VerlKey(OPT + "warmup_style", None, "actor.lr_schedule", "verl's older name of lr_scheduler_type",
            only_if=lambda verl: verl[OPT + "warmup_style"] is not None),
    VerlKey(OPT + "lr_decay_style", None, "actor.lr_schedule", "verl's Megatron name of lr_scheduler_type",
            only_if=lambda verl: verl[OPT + "lr_decay_style"] is not None),
    VerlKey(OPT + "min_lr_ratio", 0.0, "actor.min_lr_ratio"),
    VerlKey(OPT + "num_cycles", 0.5, None, "scalerl's cosine is the half cycle", inert=0.5),
    VerlKey(OPT + "optimizer", "AdamW", None, inert="AdamW"),
    # actor PPO
    VerlKey(A + "ppo_mini_batch_size", 256, "actor.ppo_mini_batch_size",
            "verl: prompts per mini-batch; scalerl: sequences (x rollout.n)", _samples_per_mini_batch),
    VerlKey(A + "ppo_micro_batch_size_per_gpu", NO_DEFAULT, "actor.ppo_micro_batch_size",
            "sequences per forward/backward on each GPU (rank), as in verl"),
    VerlKey(A + "ppo_epochs", 1, "actor.ppo_epochs"),
    VerlKey(A + "shuffle", False, "actor.shuffle", "verl's FSDP actor splits each batch into mini-batches in row order"),
    VerlKey(A + "clip_ratio", 0.2, None, "verl reads it only where clip_ratio_low/high are null; they are 0.2",
            only_if=lambda verl: False),
    VerlKey(A + "clip_ratio_low", 0.2, "actor.clip_ratio_low"),
    VerlKey(A + "clip_ratio_high", 0.2, "actor.clip_ratio_high"),
    VerlKey(A + "clip_ratio_c", 3.0, "actor.clip_ratio_c"),
    VerlKey(A + "loss_agg_mode", "token-mean", "actor.loss_agg_mode"),
    VerlKey(A + "entropy_coeff", 0.0, "actor.entropy_coeff"),
    VerlKey(A + "use_kl_loss", False, "actor.use_kl_loss"),
    VerlKey(A + "kl_loss_coef", 0.001, "actor.kl_loss_coef"),
    VerlKey(A + "kl_loss_type", "low_var_kl", "actor.kl_loss_type"),
    VerlKey(A + "policy_loss.loss_mode", "vanilla", "actor.policy_loss"),
    *(_policy_loss_key(k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")),
    VerlKey(A + "tau_pos", NO_DEFAULT, "actor.tau_pos"),
    VerlKey(A + "tau_neg", NO_DEFAULT, "actor.tau_neg"),
    VerlKey(A + "loss_scale_factor", None, None, inert=None),
    # rollout
    VerlKey(R + "n", 1, "rollout.n"),
    VerlKey(R + "temperature", 1.0, "rollout.temperature"),
    VerlKey(R + "top_p", 1.0, "rollout.top_p"),
    VerlKey(R + "max_num_seqs", 1024, "rollout.max_num_seqs", "rows decoding at once (the built-in engine's "
            "continuous batching; vLLM's scheduler limit with rollout.partial only)"),
    VerlKey(R + "top_k", -1, "rollout.top_k", "verl's -1 (off) is scalerl's 0", _top_k),
    VerlKey(R + "response_length", NO_DEFAULT, "rollout.max_new_tokens", "verl's default: data.max_response_length"),
    VerlKey(R + "name", NO_DEFAULT, "rollout.engine", "sglang and trtllm run on vllm here (same sampling)", _engine),
    VerlKey(R + "val_kwargs.temperature", 0.0, "rollout.val_temperature", "0 unless val_kwargs.do_sample",
            _val_temperature),
    VerlKey(R + "val_kwargs.do_sample", False, None, "read by val_kwargs.temperature", only_if=lambda verl: False,
            read_by=R + "val_kwargs.temperature"),
    VerlKey(R + "ignore_eos", False, None, inert=False),
    # multi-turn: verl's agent loops (docs/agents.md#verl-agent-loops)
    VerlKey(M + "enable", False, AGENT + "env", "tools: verl's tool loop over the tool config's tools; verl: the "
            "agent loops of agent_loop_config_path, as they are", _agent_env,
            only_if=lambda verl: _agent_route(verl) or bool(verl[M + "enable"]),
            also=((AGENT + "max_total_tokens", _trajectory_budget),)),
    VerlKey(M + "tool_config_path", None, AGENT + "tool_config", "verl's tool YAML, read as verl reads it",
            only_if=lambda verl: verl[M + "tool_config_path"] is not None),
    VerlKey(M + "max_assistant_turns", None, AGENT + "max_turns", "min(max_assistant_turns, max_user_turns + 1); "
            "neither: the response budget", _max_turns, only_if=_agent_route),
    VerlKey(M + "max_user_turns", None, None, "read by multi_turn.max_assistant_turns", only_if=lambda verl: False,
            read_by=M + "max_assistant_turns"),
    VerlKey(M + "max_parallel_calls", 1, AGENT + "max_tool_calls_per_turn", "verl drops the calls past it; scalerl "
            "answers them with an error message", only_if=_agent_route),
    VerlKey(M + "format", "hermes", AGENT + "tool_parser", only_if=_agent_route),
    VerlKey(M + "max_tool_response_length", 256, None, "scalerl's tool environment keeps 2048 characters of a tool's "
            "answer (the middle cut); a verl agent loop (agent_loop_config_path) reads 256", inert=256,
            only_if=_agent_route),
    VerlKey(M + "tool_response_truncate_side", "middle", None, "scalerl cuts a long tool answer in the middle",
            inert="middle", only_if=_agent_route),
    VerlKey(M + "interaction_config_path", None, AGENT + "interaction_config", "verl's BaseInteraction YAML (verl "
            "<= 0.7.1): the one a row's interaction_kwargs.name names answers each turn without a tool call",
            only_if=lambda verl: verl[M + "interaction_config_path"] is not None),
    VerlKey(M + "function_tool_path", None, AGENT + "function_tool_path", "verl's @function_tool file, its "
            "functions the tools (verl need not be installed)",
            only_if=lambda verl: verl[M + "function_tool_path"] is not None),
    VerlKey(M + "use_inference_chat_template", False, None, "scalerl trains the token ids the engine sampled, as "
            "verl does with false", inert=False),
    VerlKey(M + "num_repeat_rollouts", None, None, inert=None),
    VerlKey(AG + "agent_loop_config_path", None, AGENT + "verl_loop", "verl's agent loop YAML (- name, _target_): "
            "each row's agent_name picks a loop", only_if=lambda verl: verl[AG + "agent_loop_config_path"] is not None),
    VerlKey(AG + "default_agent_loop", "single_turn_agent", AGENT + "verl_default_loop", "the loop of rows "
            "without agent_name", only_if=lambda verl: verl[AG + "agent_loop_config_path"] is not None),
    VerlKey(AG + "custom_async_server.path", None, None, "scalerl's engine serves the loops", inert=None),
    VerlKey(AG + "custom_async_server.name", None, None, "scalerl's engine serves the loops", inert=None),
    # critic: a copy of the policy trained by the actor's optimiser (one schedule)
    VerlKey("critic.optim.lr", 1e-5, "critic.lr"),
    VerlKey("critic.cliprange_value", 0.5, "critic.cliprange_value"),
    *(VerlKey("critic." + k, NO_DEFAULT, None, SHARED_WITH_ACTOR, inert="$" + a)
      for k, a in (("optim.weight_decay", OPT + "weight_decay"), ("optim.lr_warmup_steps_ratio",
                   OPT + "lr_warmup_steps_ratio"), ("optim.lr_warmup_steps", OPT + "lr_warmup_steps"),
                   ("optim.lr_scheduler_type", OPT + "lr_scheduler_type"), ("ppo_epochs", A + "ppo_epochs"),
                   ("ppo_mini_batch_size", A + "ppo_mini_batch_size"))),
    VerlKey("critic.model.path", NO_DEFAULT, None, "scalerl's critic starts from the policy's weights",
            inert="$actor_rollout_ref.model.path"),
    # algorithm
    VerlKey("algorithm.adv_estimator", "gae", "algorithm.adv_estimator"),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", True, "algorithm.norm_adv_by_std_in_grpo"),
    VerlKey("algorithm.gamma", 1.0, "algorithm.gamma"),
    VerlKey("algorithm.lam", 1.0, "algorithm.lam"),
    VerlKey("algorithm.use_kl_in_reward", False, "algorithm.use_kl_in_reward", inert=False),
    *(VerlKey("algorithm." + k, d, "algorithm." + k, only_if=_uses_kl_in_reward)
      for k, d in (("kl_penalty", "kl"), ("kl_ctrl.type", "fixed"), ("kl_ctrl.kl_coef", 0.001),
                   ("kl_ctrl.horizon", 10000), ("kl_ctrl.target_kl", 0.1))),
    VerlKey("algorithm.use_pf_ppo", False, None, inert=False),
    # rewards
    VerlKey("custom_reward_function.path", None, "data.reward", "file.py:name, verl's signature", _reward,
            only_if=lambda verl: verl["custom_reward_function.path"] is not None),
    VerlKey("custom_reward_function.name", "compute_score", None, "read by custom_reward_function.path",
            only_if=lambda verl: False, read_by="custom_reward_function.path"),
    VerlKey("custom_reward_function.reward_kwargs", {}, None, inert={}),
    VerlKey("reward_model.enable", False, "data.reward", "verl's reward is then the model's score alone; with "
            "custom_reward_function.path scalerl adds that function's score", _reward_model_only,
            only_if=lambda verl: bool(verl["reward_model.enable"]) and verl["custom_reward_function.path"] is None),
    *(VerlKey("reward_model." + k, NO_DEFAULT, "data.reward_model." + t, only_if=_uses_reward_model)
      for k, t in (("model.path", "path"), ("micro_batch_size_per_gpu", "micro_batch_size"),
                   ("max_length", "max_length"))),
    VerlKey("reward_model.reward_manager", "naive", None, "scalerl calls the reward per sample or batched, "
            "as its signature says", inert=NO_DEFAULT),
    VerlKey("reward_model.reward_kwargs.overlong_buffer_cfg.enable", False, None, inert=False),
    VerlKey("reward_model.sandbox_fusion.url", None, None, inert=None),
    # trainer
    VerlKey("trainer.total_epochs", 30, "trainer.total_steps", "rows // train_batch_size x epochs, or "
            "trainer.total_training_steps", _total_steps,
            only_if=lambda verl: "data.train_files" in verl or verl["trainer.total_training_steps"] is not None),
    VerlKey("trainer.total_training_steps", None, None, "read by trainer.total_epochs", only_if=lambda verl: False,
            read_by="trainer.total_epochs"),
    VerlKey("trainer.save_freq", -1, "trainer.save_every", "-1: scalerl still saves the final checkpoint", _freq),
    VerlKey("trainer.test_freq", -1, "trainer.eval_every", "-1: evaluation before and after training", _freq),
    VerlKey("trainer.logger", ["console", "wandb"], "trainer.logger", "+ jsonl, scalerl's metrics file; "
            "W&B's project: WANDB_PROJECT", _loggers),
    VerlKey("trainer.default_local_dir", None, "trainer.output_dir", "verl's default: "
            "checkpoints/<project_name>/<experiment_name>", _output_dir),
    VerlKey("trainer.project_name", "verl_examples", None, "read by trainer.default_local_dir",
            only_if=lambda verl: False, read_by="trainer.default_local_dir"),
    VerlKey("trainer.experiment_name", "gsm8k", None, "read by trainer.default_local_dir",
            only_if=lambda verl: False, read_by="trainer.default_local_dir"),
    # on-policy distillation (verl 0.9.1's distillation.*: its policy-gradient form; docs/algorithms.md)
    VerlKey("distillation.enabled", False, None, "read by distillation.teacher_models.teacher_model.model_path",
            only_if=lambda verl: False, read_by=D + "teacher_models.teacher_model.model_path"),
    VerlKey(D + "teacher_models.teacher_model.model_path", None, "algorithm.distill.teacher", transform=_teacher_path,
            only_if=_single_teacher),
    VerlKey(D + "teacher_models.teacher_model.key", None, None, "verl routes every row to a single teacher (its key "
            "becomes 'default') and drops this entry when named entries are given", only_if=_distills),
    VerlKey(D + "teacher_key", "data_source", None, "read with several teachers (teacher_models.<entry>.key): "
            "scalerl routes rows by their data_source column", inert="data_source", only_if=_several_teachers),
    VerlKey(D + "distillation_loss.use_policy_gradient", False, None, "read by distillation.distillation_loss."
            "loss_mode: true for the per-token estimators (a reward), false for forward_kl_topk (a loss term)",
            only_if=lambda verl: False, read_by=D + "distillation_loss.loss_mode"),
    VerlKey(D + "distillation_loss.topk", 32, "algorithm.distill.top_k", "with loss_mode=forward_kl_topk",
            transform=lambda v, _: int(v), only_if=_topk_mode),
    VerlKey(D + "distillation_loss.loss_mode", "k3", "algorithm.distill.estimator", "the per-token estimate whose "
            "negative is the advantage (k1 is verl's recommendation with policy gradient)", transform=_distill_estimator,
            only_if=_distills),
    VerlKey(D + "distillation_loss.use_task_rewards", True, "algorithm.distill.task_weight",
            "true: the task advantage added with weight 1, false: distillation alone",
            transform=lambda v, _: 1.0 if v else 0.0, only_if=_distills),
    VerlKey(D + "distillation_loss.distillation_loss_coef", 1.0, "algorithm.distill.coef",
            "verl applies it only with use_task_rewards", transform=lambda v, verl: float(v) if verl[
                D + "distillation_loss.use_task_rewards"] else 1.0, only_if=_distills),
    VerlKey(D + "distillation_loss.loss_max_clamp", None, "algorithm.distill.max_clamp", only_if=_distills),
    VerlKey(D + "distillation_loss.log_prob_min_clamp", None, None, "no log-prob floor here", inert=None,
            only_if=_distills),
    VerlKey(D + "distillation_loss.policy_loss_mode", "vanilla", None, "the actor's policy loss, as verl requires",
            inert="vanilla", only_if=_distills),
    VerlKey("trainer.resume_mode", "auto", "trainer.resume", transform=_resume),
    VerlKey("trainer.resume_from_path", None, None, "read by trainer.resume_mode", only_if=lambda verl: False,
            read_by="trainer.resume_mode"),
    VerlKey("trainer.max_actor_ckpt_to_keep", NO_DEFAULT, "trainer.keep_last"),
    VerlKey("trainer.balance_batch", True, "trainer.balance_batch"),
    VerlKey("trainer.critic_warmup", 0, None, inert=0),
    VerlKey("trainer.val_only", False, None, inert=False),
    VerlKey("trainer.nnodes", 1, None, "the launcher sets the world size: torchrun --nnodes N "
            "--nproc-per-node G -m scalerl train --from-verl ...", only_if=lambda verl: False),
    VerlKey("trainer.n_gpus_per_node", 8, None, "the launcher sets the world size (torchrun --nproc-per-node)",
            only_if=lambda verl: False),
    VerlKey("trainer.val_before_train", True, None, "scalerl evaluates before training (metrics only)",
            only_if=lambda verl: False),
    VerlKey("actor_rollout_ref.nccl_timeout", 600, "trainer.dist_timeout_s"),
)

# verl's engine, memory and speed tuning: reported, with why it changes nothing here.
NO_EFFECT: tuple[tuple[str, str], ...] = (
    ("*.fsdp_config.*", "FSDP offload/prefetch/precision tuning; scalerl lays out with parallel.*"),
    ("*.megatron.*", "Megatron layout; scalerl lays out with parallel.* (tp, pp, dp_shard)"),
    ("*profiler*", "profiling only"),
    ("actor_rollout_ref.ref.*", "the frozen reference's batching/offload; scalerl's reference is the policy's copy"),
    (R + "log_prob_*", "log-prob recompute batching (memory only)"),
    (R + "tensor_model_parallel_size", "the rollout engine's layout follows rollout.placement"),
    (R + "gpu_memory_utilization", "vLLM memory fraction"), (R + "enforce_eager", "vLLM CUDA graphs"),
    (R + "free_cache_engine", "vLLM KV cache release"), (R + "enable_chunked_prefill", "vLLM scheduling"),
    (R + "max_num_batched_tokens", "vLLM scheduling"),
    (R + "load_format", "vLLM weight loading"), (R + "engine_kwargs.*", "engine-specific arguments"),
    (R + "mode", "sync/async server: scalerl's choice is rollout.placement"), (R + "dtype", "engine precision"),
    (R + "prompt_length", "verl's default: data.max_prompt_length"), (R + "enable_prefix_caching", "vLLM cache"),
    (R + "layered_summon", "FSDP weight gathering"), (R + "multi_stage_wake_up", "vLLM memory"),
    (R + "checkpoint_engine.*", "weight-sync buckets: weight_sync.bucket_mb"),
    (R + "calculate_log_probs", "scalerl keeps rollout log-probs"), (R + "*_parallel_size", "engine layout"),
    (R + "val_kwargs.*", "evaluation sampling (one sample per prompt here); training is unchanged"),
    (M + "tokenization_sanity_check_mode", "scalerl never re-tokenizes a conversation (the ids sampled are trained)"),
    (AG + "num_workers", "agent loop workers: here every episode of a rank runs on one event loop"),
    ("*.use_remove_padding", "padding-free rows (speed): actor.use_remove_padding is scalerl's"),
    ("*.use_fused_kernels", "fused kernels (speed)"),
    ("*.fused_kernel_options.*", "fused kernels (speed)"), ("*.use_torch_compile", "compilation (speed)"),
    ("*.use_dynamic_bsz", "token-budget micro-batches (memory); actor.micro_batch_max_tokens is scalerl's"),
    ("*max_token_len_per_gpu", "token-budget micro-batches (memory)"),
    ("*.ulysses_sequence_parallel_size", "Ulysses sequence parallelism (memory): parallel.sp is scalerl's"),
    ("*.use_shm", "loading through shared memory"), ("*.trust_remote_code", "scalerl loads known architectures"),
    ("actor_rollout_ref.hybrid_engine", "scalerl colocates by default (rollout.placement)"),
    ("*.strategy", "fsdp/megatron backend; scalerl's layout is parallel.*"),
    (A + "checkpoint.*", "checkpoint contents"), (A + "entropy_from_logits_with_chunking", "memory only"),
    (A + "entropy_checkpointing", "memory only"), (A + "freeze_vision_tower", "text models only"),
    (A + "optim.override_optimizer_config.*", "Megatron optimiser offload"),
    (A + "optim.total_training_steps", "verl fills it in from the trainer"),
    ("critic.ppo_micro_batch_size_per_gpu", "the critic's update uses actor.ppo_micro_batch_size (memory only)"),
    ("critic.model.*", "critic engine tuning; critic.model.path is checked"), ("critic.checkpoint.*", "checkpoints"),
    ("critic.forward_micro_batch_size*", "memory only"),
    ("reward_model.model.*", "reward model engine"), ("reward_model.rollout.*", "reward model engine"),
    ("reward_model.num_workers", "reward workers"),
    ("reward_model.use_reward_loop", "reward scheduling"), ("reward_model.launch_reward_fn_async", "scheduling"),
    ("reward_model.reward_kwargs.*", "overlong_buffer_cfg.enable is checked"),
    ("data.return_raw_chat", "scalerl keeps the messages"), ("data.return_*", "dataset return fields"),
    ("data.dataloader_num_workers", "loader processes"), ("data.val_batch_size", "evaluation batching"),
    ("data.image_key", "text data only here"), ("data.video_key", "text data only here"),
    ("data.filter_overlong_prompts_workers", "filter processes"), ("data.validation_shuffle", "evaluation order"),
    ("data.custom_cls.name", "read with data.custom_cls.path"),
    ("trainer.use_legacy_worker_impl", "verl worker choice"), ("trainer.log_val_generations", "logging"),
    ("trainer.device", "trainer.device=auto picks the accelerator"), ("trainer.max_critic_ckpt_to_keep",
                                                                      "kept with the actor's (trainer.keep_last)"), ("trainer.default_hdfs_dir", "remote copy"),
    ("trainer.ray_wait_register_center_timeout", "Ray start-up"), ("trainer.esi_redundant_time", "preemption"),
    ("trainer.rollout_data_dir", "dumps"), ("trainer.validation_data_dir", "dumps"),
    ("actor_rollout_ref.model.lora*", "LoRA settings, read only with lora_rank > 0 (an error here)"),
    ("algorithm.pf_ppo.*", "read only with algorithm.use_pf_ppo=true (an error here)"),
    ("reward_model.sandbox_fusion.max_concurrent", "read only with sandbox_fusion.url (an error here)"),
    (D + "n_gpus_per_node", "the teacher's resources: here it runs on the trainer's ranks"),
    (D + "nnodes", "the teacher's resources: here it runs on the trainer's ranks"),
    (D + "teacher_models.teacher_model.num_replicas", "the teacher's serving"),
    (D + "teacher_models.teacher_model.inference.*", "the teacher's inference engine: here its forward pass"),
    (D + "distillation_loss.use_chunked_topk", "top-k memory"), (D + "distillation_loss.chunked_topk_chunk_size",
                                                                 "top-k memory"),
    (D + "distillation_loss.clip_ratio*", "the distillation term's own PPO clip: here the actor's (one loss)"),
    ("global_profiler.*", "profiling only"), ("ray_kwargs.*", "Ray start-up"), ("transfer_queue.*", "verl internals"),
)


def count_rows(path: str) -> int:
    """Rows in a parquet or JSON-lines file, read from its metadata or lines (for verl's total_epochs)."""
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise ConfigError(f"data.train_files: {path} is not a file; trainer.total_epochs needs its row count "
                          "(or give trainer.total_training_steps)")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq  # only here: verl's data is parquet

        return pq.ParquetFile(p).metadata.num_rows
    if p.suffix in (".jsonl", ".json"):
        with open(p, "rb") as f:
            return sum(1 for line in f if line.strip())
    raise ConfigError(f"data.train_files: cannot count the rows of {path} (parquet or jsonl); give "
                      "trainer.total_training_steps")
