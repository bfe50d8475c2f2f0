"""Run configuration: scalerl's dataclass sections, loaded from YAML with `key.sub=value` overrides.

One `Config` describes a whole run. It is built as `defaults <- YAML file <- overrides` (later wins) and
checked completely before any work starts, so a typo fails in a second instead of after model loading:

    cfg = load_config("run.yaml", ["actor.lr=1e-6", "rollout.n=8"])

Every error is a `ConfigError` naming the full dotted key (`actor.lr must be > 0, got -1.0`). The generic
machinery (YAML, overrides, type checks) is `scalerl.core.config_tree`; this module is the schema.
"""

from __future__ import annotations

import dataclasses
import re
import string
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl.core import config_tree
from scalerl.core.algorithm_names import (
    ADVANTAGE_ESTIMATOR_NAMES,
    POLICY_LOSS_NAMES,
    choices_help,
    needs_critic,
    needs_greedy_baseline,
    needs_groups,
    not_trainable_reason,
    policy_loss_choices,
)
from scalerl.core.config_tree import (  # re-exported: `scalerl.core.config` is the public config API
    ConfigError,
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
from scalerl.core.config_tree import (
    Section as _Section,
)

__all__ = [
    "ActorSection", "AlgorithmSection", "CommSection", "Config", "ConfigError", "CriticSection", "DataSection",
    "FilterGroupsSection", "LoraSection",
    "ModelSection", "ParallelSection", "RolloutSection", "SFTSection", "TrainerSection", "WeightSyncSection",
    "apply_override", "config_from_dict",
    "config_to_dict", "config_to_yaml", "describe_keys", "format_config", "load_config", "opt", "save_config",
    "split_config_args",
]

# --------------------------------------------------------------------------------------------- schema

DTYPES = ("float32", "bfloat16", "float16")
MODEL_IMPLEMENTATIONS = ("auto", "scalerl", "transformers")
TASKS = ("arithmetic", "gsm8k", "math", "tool_arithmetic")
DATA_FORMATS = ("auto", "gsm8k", "math", "rows", "verl", "trl")
ROLLOUT_ENGINES = ("builtin", "vllm", "auto")
ROLLOUT_PLACEMENTS = ("colocated", "standalone")
LR_SCHEDULES = ("constant", "cosine")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
JUDGE_SLOTS = ("prompt", "response", "ground_truth")  # data.judge.template's slots (scalerl/data/reward_judge.py)
JUDGE_VERDICTS = ("number", "label")
DEFAULT_JUDGE_TEMPLATE = ("Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
                          "Grade the response from 0 to 10.\nGrade:")  # data.judge.template's default
KL_CONTROLLER_TYPES = ("fixed", "adaptive")  # scalerl.algorithms.kl_reward's (core sits below algorithms)
ADV_ESTIMATORS = tuple(ADVANTAGE_ESTIMATOR_NAMES)  # verl's names (`scalerl.core.algorithm_names`)
POLICY_LOSSES = tuple(policy_loss_choices())
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
DEVICES = ("auto", "cpu", "cuda")
BUILTIN_REWARDS = ("auto", "gsm8k", "math", "none", "judge")  # none: data.reward_model alone; judge: data.judge
ROLLOUT_DTYPES = ("bf16", "fp32")
# A sampling temperature below this decodes greedily (`scalerl.rollout.engine.SamplingParams`): logits / T
# overflows float32 for tiny T (NaN probabilities, an empty completion); vLLM draws its line here too.
GREEDY_BELOW_TEMPERATURE = 1e-5
STALE_LOGPROBS = ("recompute", "behavior")
IS_LEVELS = ("token", "sequence")  # scalerl.algorithms.importance's (core sits below algorithms)
IS_MODES = ("truncate", "mask")
WEIGHT_SYNC_MODES = ("full", "delta", "auto")
# The built-in model (model.path unset): its context and its vocabulary (the 99 characters of the built-in
# tokenizer, rounded up for aligned matmuls).
BUILTIN_MAX_POSITIONS = 512
BUILTIN_VOCAB_SIZE = 128


@dataclass
class LoraSection(_Section):
    """LoRA adapters on the decoder's linear layers (`scalerl.models.lora`): docs/models.md#lora."""

    name = "model.lora"
    rank: int = opt(0, "adapter rank r; 0 = no adapters (the whole model trains)")
    alpha: float = opt(16.0, "lora_alpha: the adapter's output is scaled by alpha / rank")
    dropout: float = opt(0.0, "dropout on the adapter's input (lora_dropout)", at_least=0.0, at_most=0.99)
    target_modules: list[str] = opt(help="module-name suffixes (q_proj, v_proj, ...) or full names as PEFT takes "
                                         "them, or all-linear = every linear layer of the decoder layers",
                                    factory=lambda: ["all-linear"])
    base_dtype: str | None = opt(None, "dtype the frozen base weights are held in (e.g. bfloat16; the adapters "
                                       "stay float32); null = model.dtype")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.rank >= 0, self._key("rank"), ">= 0 (0 = off)", self.rank)
        _check(p, self.alpha > 0, self._key("alpha"), "> 0", self.alpha)
        _check(p, bool(self.target_modules), self._key("target_modules"), "at least one name (or all-linear)",
               self.target_modules)
        if self.base_dtype is not None:
            _check_choice(p, self._key("base_dtype"), self.base_dtype, DTYPES)
        return p


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
    implementation: str = opt("auto", "decoder: scalerl's own | transformers' AutoModelForCausalLM (DDP/FSDP only) | "
                              "auto = scalerl's for the architectures it implements, else transformers")
    activation_checkpointing: bool = opt(False, "recompute layer activations in backward to save memory")
    moe_capacity_factor: float | None = opt(None, "MoE: each expert takes at most ceil(factor x tokens x top_k / "
                                            "num_experts) assignments per training forward, keeping those with the "
                                            "largest routing weights (moe/dropped_tokens); 0/null = no limit",
                                            at_least=0, at_most=1e6)
    lora: LoraSection = field(default_factory=LoraSection)

    def problems(self) -> list[str]:
        p: list[str] = self.lora.all_problems()
        _check_choice(p, self._key("dtype"), self.dtype, DTYPES)
        _check_choice(p, self._key("implementation"), self.implementation, MODEL_IMPLEMENTATIONS)
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
class RewardModelSection(_Section):
    """A reward model scored on the trainer ranks (`scalerl.data.reward_model`; verl's reward_model.*):
    docs/configuration.md#reward-model."""

    name = "data.reward_model"
    path: str | None = opt(None, "directory of a Qwen2/Llama *ForSequenceClassification checkpoint with one label, "
                                 "as transformers' save_pretrained writes it; null = no reward model")
    tokenizer: str | None = opt(None, "its tokenizer directory; null = data.reward_model.path")
    weight: float = opt(1.0, "the reward is data.reward's (weighted) score + weight x the model's score; with "
                             "data.reward=none the model's alone", at_least=-1e6, at_most=1e6)
    micro_batch_size: int = opt(8, "sequences per forward pass of the reward model", at_least=1)
    max_length: int | None = opt(None, "longest prompt + response in the reward model's tokens; a longer sample "
                                       "stops the run with an error naming it; null = the checkpoint's "
                                       "max_position_embeddings", at_least=1)
    dtype: str = opt("float32", "parameter dtype: " + " | ".join(DTYPES))

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "data.reward_model.dtype", self.dtype, DTYPES)
        _check(p, self.path is None or bool(self.path.strip()), "data.reward_model.path", "a directory or null",
               self.path)
        return p


def judge_template_problems(template: str, key: str = "data.judge.template") -> list[str]:
    """What is wrong with a judge template: a slot it does not know, no ``{response}``, a malformed brace."""
    try:
        slots = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as error:
        return [f"{key} is not a template ({error}); use {{prompt}}, {{response}} and {{ground_truth}}, and double a "
                "literal brace ({{ or }})"]
    problems = []
    unknown = sorted(slots - set(JUDGE_SLOTS))
    if unknown:
        problems.append(f"{key} names {', '.join('{' + s + '}' for s in unknown)}; the slots are "
                        + ", ".join("{" + s + "}" for s in JUDGE_SLOTS))
    if "response" not in slots:
        problems.append(f"{key} has no {{response}} slot: the judge would never see the response it scores")
    return problems


def parse_judge_labels(spec: str, key: str = "data.judge.labels") -> dict[str, float]:
    """``"correct=1,incorrect=0"`` as ``{"correct": 1.0, "incorrect": 0.0}``; ValueError naming the key."""
    labels: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        try:
            labels[name.strip().lower()] = float(value)
        except ValueError:
            raise ValueError(f"{key}={spec!r}: {part!r} is not label=number (e.g. correct=1,incorrect=0)") from None
        if not sep or not name.strip():
            raise ValueError(f"{key}={spec!r}: {part!r} is not label=number (e.g. correct=1,incorrect=0)")
    if not labels:
        raise ValueError(f"{key} is empty: give label=number pairs, e.g. correct=1,incorrect=0")
    return labels



@dataclass
class JudgeSection(_Section):
    """A generative judge as the reward (data.reward=judge; `scalerl.data.reward_judge`): a model prompted with a
    rubric scores each response, its verdict parsed (docs/configuration.md#generative-judges)."""

    name = "data.judge"
    model: str | None = opt(None, "the judge's model directory (any model scalerl loads); needed by data.reward=judge")
    tokenizer: str | None = opt(None, "its tokenizer directory; null = data.judge.model ('builtin' for a built-in one)")
    template: str = opt(DEFAULT_JUDGE_TEMPLATE, "the judge's prompt: {prompt}, {response} (required) and "
                                                "{ground_truth} are filled in")
    verdict: str = opt("number", "how its answer is read: number (the first number / data.judge.max_score) | label "
                                 "(the first of data.judge.labels found)")
    max_score: float = opt(10.0, "verdict=number: the grade that scores 1.0", above=0)
    labels: str = opt("correct=1,incorrect=0", "verdict=label: label=score pairs, matched as whole words")
    max_new_tokens: int = opt(16, "longest judge answer (greedy, so a response always gets the same verdict)",
                              at_least=1)
    batch_size: int = opt(16, "judge prompts per generation batch", at_least=1)
    chat_template: bool = opt(False, "send the judge prompt through its tokenizer's chat template (instruct judges)")
    dtype: str = opt("float32", "the judge's parameter dtype: " + " | ".join(DTYPES))

    def problems(self) -> list[str]:
        p: list[str] = judge_template_problems(self.template)
        _check_choice(p, "data.judge.verdict", self.verdict, JUDGE_VERDICTS)
        _check_choice(p, "data.judge.dtype", self.dtype, DTYPES)
        if self.verdict == "label":
            try:
                parse_judge_labels(self.labels)
            except ValueError as error:
                p.append(str(error))
        return p


@dataclass
class DataSection(_Section):
    name = "data"
    task: str = opt("arithmetic", "built-in task: " + " | ".join(TASKS))
    train_files: list[str] = opt(help="training prompt files (parquet/jsonl); empty = generate/download", factory=list)
    val_files: list[str] = opt(help="validation prompt files", factory=list)
    prompt_template: str | None = opt(None, "format string for the prompt; null = the task's default")
    # Data file formats and their column names (docs/configuration.md#data-formats; verl's key names).
    format: str = opt("auto", "data file format: " + " | ".join(DATA_FORMATS) + "; auto = told from each file's "
                      "columns, the task's own format first")
    prompt_key: str = opt("prompt", "column holding the prompt (rows, verl, trl): text or chat messages "
                          "[{role, content}], the latter rendered with the tokenizer's chat template")
    ground_truth_key: str | None = opt(None, "column holding the ground truth, dotted for a nested field; "
                                       "null = reward_model.ground_truth (verl), ground_truth (rows, trl)")
    reward_fn_key: str = opt("data_source", "verl's: the column handed to the reward as data_source")
    split: str = opt("train", "split read from a DatasetDict.save_to_disk directory in data.train_files")
    val_split: str = opt("test", "split read from a DatasetDict.save_to_disk directory in data.val_files")
    difficulty: list[int] = opt(help="arithmetic task: difficulty levels to sample", factory=lambda: [1, 2])
    num_train: int = opt(4000, "generated tasks: number of training prompts")
    num_val: int = opt(200, "validation prompts: the built-in task's count, and the most read from data.val_files "
                       "or held out from data.train_files")
    val_fraction: float = opt(0.02, "without data.val_files: the share of data.train_files' rows held out for "
                              "evaluation (disjoint, fixed by trainer.seed, at most data.num_val; said at start); "
                              "0 = no evaluation", at_least=0, below=1)
    max_prompt_length: int = opt(64, "longest prompt in tokens; a longer one stops the run with an error naming it")
    chat_template: bool = opt(False, "send each prompt as a user message through the tokenizer's chat template")
    reward: str = opt("auto", "auto (verl's scorer by each row's data_source; rows without one: the task's) | "
                      "gsm8k | math | judge (a generative judge model: data.judge.*) | module:function (searched in the current directory first, then sys.path) | "
                      "file.py:function (relative to the current directory); the function may have scalerl's, "
                      "verl's (compute_score, single or batched) or TRL's signature; several comma-separated are "
                      "added up with data.reward_weights | http(s)://host:port/path (a reward server, "
                      "docs/configuration.md#reward-workers-and-reward-servers) | none (with data.reward_model.path: the "
                      "reward model's score alone)")
    reward_timeout_s: float = opt(30.0, "limit for one reward call (a batched function: for the batch); a call that "
                                  "runs longer scores 0 and counts in reward/num_failures, like one that raises; "
                                  "after a timeout the batch's other calls overlap under one deadline", above=0)
    # Negative weights are allowed (TRL uses them for penalties); beyond a million is taken for a typo.
    reward_weights: list[float] = opt(help="one weight per data.reward function; empty = 1 each", factory=list,
                                      at_least=-1e6, at_most=1e6)
    max_reward_failures: int = opt(256, "stop the run once this many samples in a row failed to score (raised, "
                                   "timed out, not a number); 0 = never stop", at_least=0)
    reward_workers: int = opt(0, "score in this many worker processes per trainer rank, each importing data.reward "
                              "from its spec (0 = in the trainer's process); a reward server gets this many "
                              "requests in flight (0 = 1)", at_least=0)
    reward_batch_size: int = opt(64, "reward server: samples per request", at_least=1)
    reward_retries: int = opt(2, "reward server: retries of a request that timed out, could not connect or got "
                              "HTTP 429/5xx, after 0.5 s, 1 s, 2 s...", at_least=0)
    shuffle: bool = opt(True, "shuffle training prompts every epoch")
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    judge: JudgeSection = field(default_factory=JudgeSection)
    streaming: bool = opt(False, "read data.train_files (Parquet, Arrow, save_to_disk) lazily by row group, each "
                          "data-parallel rank its own share, instead of whole into memory; data.num_train does "
                          "not apply, validation files are still read whole")
    shuffle_buffer: int = opt(10000, "data.streaming: rows held and shuffled together (a window of the stream); "
                              "memory grows with it, not with the dataset", at_least=1)

    def problems(self) -> list[str]:
        p: list[str] = self.reward_model.all_problems() + self.judge.all_problems()
        if "judge" in [spec.strip() for spec in self.reward.split(",")] and not self.judge.model:
            p.append("data.reward=judge needs data.judge.model (the judge's model directory)")
        _check_choice(p, "data.task", self.task, TASKS)
        _check(p, len(self.difficulty) >= 1 and all(d >= 1 for d in self.difficulty), "data.difficulty",
               "a non-empty list of levels >= 1", self.difficulty)
        _check(p, self.num_train >= 1, "data.num_train", ">= 1", self.num_train)
        _check(p, self.num_val >= 0, "data.num_val", ">= 0", self.num_val)
        _check(p, self.max_prompt_length >= 1, "data.max_prompt_length", ">= 1", self.max_prompt_length)
        _check_choice(p, "data.format", self.format, DATA_FORMATS)
        for key in ("prompt_key", "ground_truth_key", "reward_fn_key", "split", "val_split"):
            value = getattr(self, key)  # only ground_truth_key may be null; the type check sees to that
            _check(p, value is None or bool(value.strip()), f"data.{key}", "a non-empty column or split name", value)
        if self.format != "auto" and self.task == "arithmetic" and not self.train_files:
            p.append(f"data.format={self.format} is not used by data.task=arithmetic without data.train_files (the "
                     "built-in task makes its own rows); remove it, or give data files")
        specs = [spec.strip() for spec in self.reward.split(",")]
        p += _reward_model_problems(self.reward, self.reward_model.path)
        if not all(spec in BUILTIN_REWARDS or ":" in spec for spec in specs):
            p.append(f"data.reward must be one of {', '.join(BUILTIN_REWARDS)}, 'module:function' or "
                     f"'file.py:function' (or several, comma-separated); got {self.reward!r}")
        for spec in specs:
            if "://" in spec and not spec.startswith(("http://", "https://")):
                p.append(f"data.reward {spec!r}: only http:// and https:// reward servers are accepted")
        if self.reward_weights and len(self.reward_weights) != len(specs):
            p.append(f"data.reward_weights has {len(self.reward_weights)} weights for the {len(specs)} functions of "
                     f"data.reward={self.reward!r}; give one per function, or none")
        if self.streaming and not self.train_files:
            p.append("data.streaming=true streams data.train_files, and there are none (the built-in task makes "
                     "its rows in memory); give data.train_files, or set data.streaming=false")
        if self.prompt_template is not None and self.task == "arithmetic" and not self.train_files:
            # the built-in task writes its own prompts; a template given for it would silently do nothing
            p.append(f"data.prompt_template={self.prompt_template!r} is not used by data.task=arithmetic without "
                     "data.train_files (the built-in task writes its own prompts); remove it, or give data files")
        return p


def _reward_model_problems(reward: str, model_path: str | None) -> list[str]:
    """data.reward=none (the reward model's score alone) needs the model, and stands alone."""
    specs = [spec.strip() for spec in reward.split(",")]
    if "none" in specs and len(specs) > 1:
        return [f"data.reward={reward!r}: 'none' (no rule reward) cannot be combined with other rewards"]
    if specs == ["none"] and not model_path:
        return ["data.reward=none needs data.reward_model.path (a reward model to score with)"]
    return []


@dataclass
class AgentSection(_Section):
    """Multi-turn rollouts (scalerl/rollout/agent/): each sample an episode against an environment, its
    tool results and user turns in the trajectory as context, only the engine's tokens trained."""

    name = "rollout.agent"
    env: str | None = opt(None, "the environment: tools (the built-in tool environment over rollout.agent.tools) | "
                                "chat (scripted user turns, the row's 'turns') | module:Class | path/file.py:Class; "
                                "null = single-turn rollouts")
    tools: str | None = opt(None, "with env=tools (or beside a TRL environment's methods): plain Python functions as "
                                  "tools, module:fn1,fn2 or path/file.py:fn1,fn2 (the JSON schema from each "
                                  "signature and docstring; TRL's tools=[...] functions as they are)")
    tool_config: str | None = opt(None, "with env=tools: verl's tool config YAML (tools: - class_name, config, "
                                        "tool_schema; verl's multi_turn.tool_config_path), its BaseTool classes as "
                                        "tools, one instance per trajectory (docs/agents.md)")
    tool_parser: str = opt("hermes", "the model's tool-call format (hermes: Qwen2.5/Qwen3 <tool_call>{json}</tool_call>)")
    sandbox: str | None = opt(None, "with env=tools: add a python tool whose code runs in this sandbox: process (the "
                                    "built-in: own process group, rlimits, no network, as an unprivileged uid) | "
                                    "module:Class | path/file.py:Class (anything with exec(code, limits)); null = "
                                    "no python tool")
    system: str | None = opt(None, "with env=tools: a system message before the row's prompt")
    max_turns: int = opt(4, "engine turns per episode at most", at_least=1)
    max_tool_calls_per_turn: int = opt(4, "tool calls run per turn at most (more are answered with an error)",
                                       at_least=1)
    max_total_tokens: int = opt(0, "tokens per trajectory at most (prompt, turns and environment answers); 0 = "
                                   "data.max_prompt_length + max_turns x (rollout.max_new_tokens + 64)", at_least=0)
    env_timeout_s: float = opt(300.0, "seconds one reset or step of the environment (its tools included) may take; "
                                      "past it the episode ends as an environment error, the batch goes on", above=0)

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.env == "tools" and not (self.tools or self.sandbox or self.tool_config):
            p.append("rollout.agent.env=tools needs rollout.agent.tools (module:fn1,fn2 or path/file.py:fn1,fn2), "
                     "rollout.agent.tool_config (verl's tool YAML) or rollout.agent.sandbox=process (a python tool)")
        if self.tool_config is not None and self.env != "tools":
            p.append(f"rollout.agent.tool_config={self.tool_config!r} is read with rollout.agent.env=tools (got env="
                     f"{self.env}): set rollout.agent.env=tools")
        return p


@dataclass
class RolloutSection(_Section):
    name = "rollout"
    engine: str = opt("builtin", "generation engine: " + " | ".join(ROLLOUT_ENGINES))
    n: int = opt(8, "samples per prompt (the GRPO group size)")
    temperature: float = opt(1.0, "sampling temperature for training rollouts (GRPO needs > 0)", at_least=0)
    top_p: float = opt(1.0, "nucleus sampling mass, 0 < top_p <= 1", above=0, at_most=1)
    top_k: int = opt(0, "keep the k most likely tokens; 0 = off")
    max_new_tokens: int = opt(16, "response length limit in tokens")
    max_num_seqs: int = opt(0, "rows decoding at once. Built-in engine: a larger batch is continuously batched (a "
                               "finished row's slot refilled from the rest at once); 0 = one fixed batch per "
                               "generate call (finished rows compacted out). vLLM: its max_num_seqs with "
                               "rollout.partial (its asynchronous engine; 0 = vLLM's default); without "
                               "rollout.partial vLLM keeps its default", at_least=0)
    val_temperature: float = opt(0.0, "sampling temperature for evaluation; 0 = greedy", at_least=0)
    placement: str = opt("colocated", "colocated (the trainer's ranks generate with the trained weights) | "
                                      "standalone (rollout.workers extra ranks with their own copy)")
    workers: int = opt(1, "standalone: rollout worker ranks, the last ranks of the world")
    dtype: str = opt("fp32", "standalone: the workers' weight dtype, and what weight sync sends; with "
                             "rollout.engine=vllm also the colocated engine's: " + " | ".join(ROLLOUT_DTYPES))
    vllm_kv_cache_gib: float = opt(1.0, "rollout.engine=vllm: the KV cache vLLM reserves, in GiB (its own default "
                                        "takes most of the free memory)", above=0)
    vllm_tensor_parallel_size: int = opt(1, "rollout.engine=vllm: devices each vLLM engine spans (vLLM's tensor "
                                            "parallelism; GPUs only, at most the GPUs visible to it; refused on "
                                            "CPU)", at_least=1)
    staleness: int = opt(0, "standalone: K >= 0, the most policy versions a trained sample may lag: the prompts "
                            "of steps k+1..k+K go to the workers while step k trains (0 = synchronous, 1 = one-step "
                            "asynchronous); older samples are dropped from the loss and counted")
    partial: bool = opt(False, "standalone, rollout.staleness >= 1: workers stream (continuous batching over every "
                               "request in flight) and a weight sync lands between two engine steps without waiting "
                               "for the rows in flight, which go on with the new weights (one response may mix "
                               "versions, recorded per token); timing-dependent, so not bitwise reproducible")
    stream_groups: bool = opt(False, "standalone, rollout.workers >= 2, parallel.pp=1: the trainer takes each "
                                     "worker's part of a step (whole prompt groups) as it arrives and scores it and "
                                     "runs its old/reference log-prob passes while the other workers still "
                                     "generate, and, where nothing later reads the weights it changes (see "
                                     "docs: actor.shuffle=false, no critic, a group-wise estimator), "
                                     "takes the update's first mini-batches whose groups are in; the step's "
                                     "result is the same as without (timing_s/stream_overlap: the trainer's "
                                     "seconds of such work before the last part came)")
    is_level: str = opt("token", "off-policy correction of rollouts sampled by other weights or numerics: one "
                                 "importance weight per token | per sequence (" + " | ".join(IS_LEVELS) + ")")
    is_mode: str = opt("truncate", "what the cap does to a weight above it: truncate (min(w, cap), verl's TIS) | "
                                   "mask (0: TRL's *_mask, AReaL's decoupled PPO at is_level=token)")
    is_cap: float = opt(2.0, "importance weight cap, w = exp(old - rollout log-prob) per token or sequence; "
                             "0 = no correction", at_least=0)
    tis_cap: float | None = opt(None, "alias of rollout.is_cap kept for existing configs; when set it is the cap")
    stale_logprobs: str = opt("recompute", "rollout.staleness >= 1: PPO's old log-probs are recomputed with the "
                                           "current weights (recompute: the proximal policy of decoupled PPO; the "
                                           "rollout's own weigh the loss per rollout.is_*) or are the rollout's own, "
                                           "the behaviour policy's (behavior: standard PPO, no extra forward; fp32 "
                                           "workers only, whose log-probs equal the trainer's forward)")

    agent: AgentSection = field(default_factory=AgentSection)

    @property
    def correction_cap(self) -> float:
        """The importance weight cap in force: rollout.tis_cap where a config sets it, else rollout.is_cap."""
        return self.is_cap if self.tis_cap is None else self.tis_cap

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "rollout.engine", self.engine, ROLLOUT_ENGINES)
        _check(p, self.n >= 1, "rollout.n", ">= 1", self.n)
        _check(p, self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)
        _check(p, self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        if 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            # the engines decode greedily there (log-probs at temperature 1), the update's log-probs would not
            p.append(f"rollout.temperature={self.temperature:g} is below {GREEDY_BELOW_TEMPERATURE:g}, where rollouts "
                     "decode greedily while the update would divide the logits by it; set rollout.temperature=0 "
                     f"for greedy decoding, or >= {GREEDY_BELOW_TEMPERATURE:g}")
        _check_choice(p, "rollout.placement", self.placement, ROLLOUT_PLACEMENTS)
        _check(p, self.workers >= 1, "rollout.workers", ">= 1", self.workers)
        _check_choice(p, "rollout.dtype", self.dtype, ROLLOUT_DTYPES)
        if self.vllm_tensor_parallel_size > 1 and self.engine == "builtin":
            p.append(f"rollout.vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} applies to vLLM only "
                     "(rollout.engine=vllm or auto); the built-in engine's tensor parallelism is parallel.tp")
        _check(p, self.staleness >= 0, "rollout.staleness", ">= 0", self.staleness)
        _check_choice(p, "rollout.is_level", self.is_level, IS_LEVELS)
        _check_choice(p, "rollout.is_mode", self.is_mode, IS_MODES)
        _check(p, self.tis_cap is None or self.tis_cap >= 0, "rollout.tis_cap", ">= 0 or null", self.tis_cap)
        _check_choice(p, "rollout.stale_logprobs", self.stale_logprobs, STALE_LOGPROBS)
        if self.stale_logprobs == "behavior" and not (self.staleness and self.dtype == "fp32"):
            p.append("rollout.stale_logprobs=behavior needs rollout.staleness >= 1 and rollout.dtype=fp32 (got "
                     f"staleness={self.staleness}, dtype={self.dtype}): without staleness the rollouts are on-policy "
                     "already, and bf16 workers' log-probs differ from the trainer's forward, so they are recomputed")
        if self.partial and (self.placement != "standalone" or not self.staleness):
            p.append(f"rollout.partial=true needs rollout.placement=standalone and rollout.staleness >= 1 (got "
                     f"placement={self.placement}, staleness={self.staleness}): a partial rollout is one a weight push "
                     "to standalone workers lands in, and at staleness 0 no rollout is in flight during a push; "
                     "set rollout.partial=false or raise rollout.staleness")
        if self.stream_groups and (self.placement != "standalone" or self.workers < 2):
            p.append(f"rollout.stream_groups=true needs rollout.placement=standalone and rollout.workers >= 2 (got "
                     f"placement={self.placement}, workers={self.workers}): it overlaps the trainer's work on one "
                     "worker's finished groups with the others' generation, and colocated or with one worker the "
                     "whole batch arrives at once; set rollout.stream_groups=false or add rollout workers")
        p += self.agent.all_problems()
        if self.agent.env and (self.placement != "colocated" or self.engine != "builtin"):
            p.append(f"rollout.agent.env={self.agent.env} runs colocated on the built-in engine for now (got "
                     f"placement={self.placement}, engine={self.engine}); set rollout.placement=colocated and "
                     "rollout.engine=builtin")
        if self.placement == "colocated" and (self.staleness or (self.dtype != "fp32" and self.engine == "builtin")):
            p.append("rollout.staleness and rollout.dtype apply to rollout.placement=standalone only (dtype also "
                     "to rollout.engine=vllm) "
                     f"(got staleness={self.staleness}, dtype={self.dtype} with placement=colocated)")
        return p


@dataclass
class WeightSyncSection(_Section):
    """Pushing the trainer's weights to rollout engines that hold their own copy (scalerl/comm/weights/sender.py)."""

    name = "weight_sync"
    mode: str = opt("delta", "full (dense push every sync) | delta (only elements whose rollout.dtype bits "
                    "changed; lossless, verified by checksums) | auto (per sync, deltas or dense buckets, "
                    "whichever has cost less time per element: dense next to the trainer, deltas over slow links)")
    bucket_mb: float = opt(64.0, "bucket size in MiB of rollout.dtype elements: tensors are gathered and sent one "
                           "bucket at a time, bounding the extra memory", above=0)
    static_every: int = opt(0, "lossy option: defer a tensor whose largest change since its last push is below "
                            "static_threshold for up to this many syncs; 0 = off (lossless)")
    static_threshold: float = opt(0.0, "lossy option: largest absolute change a deferred tensor may carry",
                                  at_least=0)
    background: bool = opt(True, "standalone workers with rollout.staleness >= 1: after the optimizer step, the "
                                 "trainer takes a snapshot of the weights and a background thread pushes it, so "
                                 "the next step does not wait "
                                 "for the push (false: the push runs in the step)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "weight_sync.mode", self.mode, WEIGHT_SYNC_MODES)
        _check(p, self.static_every >= 0, "weight_sync.static_every", ">= 0 (0 = off)", self.static_every)
        if self.static_every > 0 and self.mode != "delta":
            p.append(f"weight_sync.static_every={self.static_every} defers tensors between delta syncs; "
                     f"it needs weight_sync.mode=delta, got {self.mode!r}")
        if self.static_every > 0 and self.static_threshold <= 0:
            p.append("weight_sync.static_every > 0 needs weight_sync.static_threshold > 0 "
                     "(the largest change a deferred tensor may carry)")
        return p


def _check_optimizer(p: list[str], prefix: str, warmup_steps: int, lr_schedule: str) -> None:
    """Checks shared by the actor and SFT optimizer settings (their floats carry bounds of their own)."""
    _check(p, warmup_steps >= 0, f"{prefix}.warmup_steps", ">= 0", warmup_steps)
    _check_choice(p, f"{prefix}.lr_schedule", lr_schedule, LR_SCHEDULES)


@dataclass
class ActorSection(_Section):
    name = "actor"
    lr: float = opt(1e-4, "peak learning rate", above=0)
    weight_decay: float = opt(0.0, "AdamW weight decay", at_least=0)
    betas: list[float] = opt(help="AdamW betas [beta1, beta2]", factory=lambda: [0.9, 0.999], at_least=0, below=1)
    warmup_steps: int = opt(0, "linear warmup steps (optimizer steps)")
    lr_schedule: str = opt("constant", "after warmup: " + " | ".join(LR_SCHEDULES))
    min_lr_ratio: float = opt(0.0, "cosine schedule floor as a fraction of lr", at_least=0, at_most=1)
    grad_clip: float = opt(1.0, "max gradient norm; 0 = off", at_least=0)
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    ppo_mini_batch_size: int = opt(64, "sequences per optimizer step")
    ppo_micro_batch_size: int = opt(16, "sequences per forward/backward (gradient accumulation)")
    shuffle: bool = opt(True, "each epoch's mini-batches take the batch's rows in a shuffled order (false: in "
                              "row order, verl's FSDP actor; with rollout.stream_groups the first mini-batches "
                              "can then start while later groups still generate)")
    micro_batch_max_tokens: int = opt(
        0, "dynamic batch size: pack micro-batches up to this many tokens (padded ones; real ones with "
        "use_remove_padding); 0 = fixed ppo_micro_batch_size"
    )
    use_remove_padding: bool = opt(False, "verl's name: update, log-prob and critic passes run on packed rows of "
                                   "real tokens (no padding; attention per sequence; built-in decoder only)")
    clip_ratio_low: float = opt(0.2, "PPO clip: ratio >= 1 - clip_ratio_low", at_least=0)
    clip_ratio_high: float = opt(0.2, "PPO clip: ratio <= 1 + clip_ratio_high", at_least=0)
    # dual clip bounds the loss of negative-advantage tokens from below; <= 1 would cut into the PPO clip
    clip_ratio_c: float = opt(3.0, "dual-clip bound for negative advantages (> 1)", above=1)
    loss_agg_mode: str = opt("token-mean", "loss aggregation: " + " | ".join(LOSS_AGG_MODES))
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient (a bonus: negative would push entropy down)",
                               at_least=0)
    use_kl_loss: bool = opt(False, "add a KL penalty to a frozen reference model to the loss")
    kl_loss_coef: float = opt(0.001, "KL penalty coefficient", at_least=0)
    kl_loss_type: str = opt("low_var_kl", " | ".join(KL_LOSS_TYPES) + "; a trailing '+' uses the straight-through form")
    policy_loss: str = opt("vanilla", "policy loss by verl's name (docs/algorithms-formulas.md); verl's recipes pair "
                           "gspo with actor.loss_agg_mode=seq-mean-token-mean (sapo and geo_mean aggregate their "
                           "own way since verl 0.9.1, whatever the mode):"
                           + choices_help(POLICY_LOSS_NAMES))
    # verl's option names for the other losses (read by the loss named in its description)
    tau_pos: float = opt(1.0, "sapo: sigmoid temperature for positive advantages", above=0)
    tau_neg: float = opt(1.05, "sapo: sigmoid temperature for negative advantages", above=0)
    clip_cov_ratio: float = opt(0.0002, "clip_cov: share of tokens whose gradient is cut", above=0, at_most=1)
    clip_cov_lb: float = opt(1.0, "clip_cov: lower bound of the covariance of the tokens it may cut", at_least=0)
    clip_cov_ub: float = opt(5.0, "clip_cov: upper bound of the covariance of the tokens it may cut", above=0)
    kl_cov_ratio: float = opt(0.0002, "kl_cov: share of tokens (highest covariance) given the |log r| penalty",
                              above=0, at_most=1)
    ppo_kl_coef: float = opt(0.1, "kl_cov: coefficient of the |log r| penalty", at_least=0)
    mask_truncated_completions: bool = opt(False, "TRL's: responses cut off at rollout.max_new_tokens count in no "
                                           "loss and no token count (their share: response_length/clip_ratio)")
    router_replay: bool = opt(False, "MoE models: rollout routing replay (R3). The built-in engine records the "
                              "experts each token was routed to, and the old/reference log-prob passes and the "
                              "update route by them (gate weights recomputed from the current router at those "
                              "experts), so router drift between engine and trainer cannot move a token to other "
                              "experts. Built-in engine, colocated, fixed batch (rollout.max_num_seqs=0), no "
                              "packing, no tp/pp/sp/ep; refused on a dense model")

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.router_replay and self.use_remove_padding:
            p.append("actor.router_replay=true with actor.use_remove_padding=true: recorded routes are laid out like "
                     "padded rows, not packed ones; set actor.use_remove_padding=false or actor.router_replay=false")
        _check_optimizer(p, "actor", self.warmup_steps, self.lr_schedule)
        _check(p, len(self.betas) == 2, "actor.betas", "two values in [0, 1)", self.betas)
        _check(p, self.ppo_epochs >= 1, "actor.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(p, self.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", ">= 1", self.ppo_mini_batch_size)
        _check(p, self.ppo_micro_batch_size >= 1, "actor.ppo_micro_batch_size", ">= 1", self.ppo_micro_batch_size)
        _check_choice(p, "actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_choice(p, "actor.policy_loss", self.policy_loss, POLICY_LOSSES)
        if (why := not_trainable_reason("actor.policy_loss", self.policy_loss)) is not None:
            p.append(why)
        if self.clip_cov_lb >= self.clip_cov_ub:
            p.append(f"actor.clip_cov_lb ({self.clip_cov_lb}) must be below actor.clip_cov_ub ({self.clip_cov_ub})")
        if self.kl_loss_type.removesuffix("+") not in KL_LOSS_TYPES:
            p.append(f"actor.kl_loss_type must be one of {', '.join(KL_LOSS_TYPES)} (optionally with a "
                     f"trailing '+'); got {self.kl_loss_type!r}")
        if not p and self.ppo_mini_batch_size % self.ppo_micro_batch_size:
            p.append(f"actor.ppo_micro_batch_size ({self.ppo_micro_batch_size}) must divide "
                     f"actor.ppo_mini_batch_size ({self.ppo_mini_batch_size})")
        return p


@dataclass
class CriticSection(_Section):
    """Value model settings; used when algorithm.adv_estimator needs a critic (gae)."""

    name = "critic"
    lr: float = opt(1e-4, "critic learning rate", above=0)
    cliprange_value: float = opt(0.5, "value clipping range around the old values", at_least=0)
    value_loss_coef: float = opt(0.5, "value loss weight", at_least=0)


def _estimator_help() -> str:
    """`algorithm.adv_estimator`'s help: every name with its line and what it needs beyond the rollouts."""
    rows = {}
    for name, entry in ADVANTAGE_ESTIMATOR_NAMES.items():
        needs = ("trains a critic" if needs_critic(name) else
                 "one greedy response per prompt as the baseline" if needs_greedy_baseline(name) else
                 "" if needs_groups(name) else "no groups: rollout.n may be 1")
        rows[name] = entry.description + (f" [{needs}]" if needs else "")
    return ("advantage estimator by verl's name (docs/algorithms-formulas.md); unless marked, it compares the "
            "rollout.n >= 2 samples of each prompt:" + choices_help(rows))


FILTER_GROUPS_METRICS = ("score",)  # per-sample values dynamic sampling can test for zero variance


@dataclass
class FilterGroupsSection(_Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): drop the prompt groups whose metric has zero
    variance and draw more prompts until the batch is full (docs/algorithms.md, Dynamic sampling)."""

    name = "algorithm.filter_groups"
    enable: bool = opt(False, "drop groups whose samples all share one metric value (their GRPO advantages are 0) "
                              "and generate further batches until trainer.batch_size groups remain")
    metric: str = opt("score", "the per-sample value tested: " + " | ".join(FILTER_GROUPS_METRICS)
                               + " (the reward before any shaping)")
    max_num_gen_batches: int = opt(10, "most generation rounds per step; once reached the step trains on the groups "
                                       "kept so far (filter/batch_full=0); 0 = no limit")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.filter_groups.metric", self.metric, FILTER_GROUPS_METRICS)
        _check(p, self.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches", ">= 0 (0 = no limit)",
               self.max_num_gen_batches)
        return p


@dataclass
class OverlongBufferSection(_Section):
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): 0 up to rollout.max_new_tokens - len
    response tokens, then linearly down to -penalty_factor at rollout.max_new_tokens, added to the score."""

    name = "algorithm.overlong_buffer"
    enable: bool = opt(False, "add the overlong penalty to every score (reward/overlong_penalty/mean)")
    len: int = opt(0, "the buffer: the last len tokens before rollout.max_new_tokens are penalised", at_least=0)
    penalty_factor: float = opt(1.0, "the penalty at rollout.max_new_tokens tokens", at_least=0)


@dataclass
class DistillSection(_Section):
    """On-policy distillation (docs/algorithms.md, On-policy distillation): a teacher scores the student's own
    sampled tokens and each token's advantage is ``-coef * k(student, teacher)`` (with k1: ``coef * (log p_teacher -
    log p_student)``, the negative reverse KL on that token), added to ``task_weight`` times the task reward's
    advantage."""

    name = "algorithm.distill"
    teacher: str | None = opt(None, "the teacher's model directory (same tokenizer as the student); null = off")
    coef: float = opt(1.0, "weight of the per-token distillation advantage", above=0)
    task_weight: float = opt(0.0, "weight of algorithm.adv_estimator's advantage from the task reward "
                                  "(0 = distillation alone; the reward is still scored and logged)", at_least=0)
    estimator: str = opt("k1", "the per-token KL estimate whose negative is the advantage: " + " | ".join(KL_LOSS_TYPES)
                         + " (k1: teacher log-prob - student log-prob; verl's distillation_loss.loss_mode)")
    max_clamp: float | None = opt(None, "clamp each token's estimate to [-max_clamp, max_clamp] (verl's "
                                        "loss_max_clamp); null = none")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.distill.estimator", self.estimator, KL_LOSS_TYPES)
        if self.max_clamp is not None and not self.max_clamp > 0:
            p.append(f"algorithm.distill.max_clamp must be > 0 or null, got {self.max_clamp}")
        if self.teacher is not None and not str(self.teacher).strip():
            p.append("algorithm.distill.teacher is empty: give the teacher's model directory, or null for no "
                     "distillation")
        return p


@dataclass
class KLControlSection(_Section):
    """The coefficient beta of KL in the reward (verl's algorithm.kl_ctrl), read with algorithm.use_kl_in_reward."""

    name = "algorithm.kl_ctrl"
    type: str = opt("fixed", "fixed (beta = kl_coef) | adaptive (beta moves to keep the KL at target_kl)")
    kl_coef: float = opt(0.001, "beta (adaptive: its initial value)", at_least=0)
    target_kl: float = opt(0.1, "adaptive: the KL beta steers toward", above=0)
    horizon: int = opt(10000, "adaptive: sequences over which beta moves by up to 20%", at_least=1)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.kl_ctrl.type", self.type, KL_CONTROLLER_TYPES)
        return p


@dataclass
class AlgorithmSection(_Section):
    name = "algorithm"
    adv_estimator: str = opt("grpo", _estimator_help())
    norm_adv_by_std_in_grpo: bool = opt(True, "GRPO: divide by the group's reward std (false = Dr. GRPO)")
    gamma: float = opt(1.0, "discount: gae, reinforce_plus_plus", at_least=0, at_most=1)
    lam: float = opt(1.0, "GAE lambda", at_least=0, at_most=1)
    # Reward shaping (scalerl/trainer/reward_shaping.py; verl's names, docs/algorithms.md#reward-shaping)
    use_kl_in_reward: bool = opt(False, "subtract beta * KL(policy || reference) from the token rewards (builds the "
                                 "reference model; beta from algorithm.kl_ctrl)")
    kl_penalty: str = opt("kl", "the KL estimate in the reward: " + " | ".join(KL_LOSS_TYPES))
    kl_ctrl: KLControlSection = field(default_factory=KLControlSection)
    overlong_buffer: OverlongBufferSection = field(default_factory=OverlongBufferSection)
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        if (why := not_trainable_reason("algorithm.adv_estimator", self.adv_estimator)) is not None:
            p.append(why)
        _check_choice(p, "algorithm.kl_penalty", self.kl_penalty, KL_LOSS_TYPES)
        p += self.kl_ctrl.all_problems() + self.overlong_buffer.all_problems()
        p += self.filter_groups.all_problems() + self.distill.all_problems()
        return p


@dataclass
class SFTSection(_Section):
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
        _check_optimizer(p, "sft", self.warmup_steps, self.lr_schedule)
        if self.output_dir is not None and not self.output_dir.strip():
            p.append("sft.output_dir is empty: give a directory, or null for <trainer.output_dir>/sft")
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
    ep: int = opt(1, "expert parallelism: a MoE model's experts sharded over the data-parallel ranks, tokens routed "
                     "by all-to-all (1 = off; under DDP parallel.dp_replicate, under FSDP2 a divisor of "
                     "dp_replicate x dp_shard)")
    sp: int = opt(1, "Ulysses sequence parallelism: the sequence of update, log-prob and critic passes split over "
                     "sp ranks of each data-parallel replica, attention by all-to-all over heads (heads must divide "
                     "by sp; kv heads too, or divide sp); generation runs unsplit")
    reorder_ranks_by_node: bool = opt(True, "when the launcher numbered ranks across nodes in turn, build the "
                                            "device mesh with each node's ranks contiguous (rings cross nodes "
                                            "less; RANK numbers are kept)")

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
        _check(p, self.ep >= 1, "parallel.ep", ">= 1", self.ep)
        _check(p, self.sp >= 1, "parallel.sp", ">= 1", self.sp)
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
                                      "(virtual or shaped links); 0 = read it from the topology", at_least=0)
    gradient_compression: str = opt("none", "DDP gradient compression: " + " | ".join(GRADIENT_COMPRESSIONS) +
                                    "; powersgd and topk keep an error-feedback residual")
    layer_adaptive: bool = opt(True, "powersgd/topk: per-tensor rank/density chosen from measured gradient "
                                     "statistics under comm.compression_budget (else comm.topk_density / "
                                     "comm.powersgd_rank for every tensor)")
    compression_budget: float = opt(0.1, "layer-adaptive: bytes each rank contributes per reduction, as a fraction "
                                         "of the dense fp32 gradient's bytes (0.1 = 90% fewer)", above=0, at_most=1)
    topk_density: float = opt(0.01, "topk without layer_adaptive: fraction of each tensor's elements sent",
                              above=0, at_most=1)
    topk_momentum: float = opt(0.0, "topk: Deep Gradient Compression momentum correction factor (momentum "
                                    "accumulated before sparsification); 0 = plain error feedback, which suits "
                                    "AdamW (it keeps its own moments)", at_least=0, below=1)
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


def sequence_parallel_head_problems(sp: int, heads: int, kv_heads: int, prefix: str = "") -> list[str]:
    """Ulysses' head rule: each of the sp ranks attends with ``heads / sp`` query heads, so sp divides the
    heads; kv heads are split the same way, or, when fewer than sp, each replicated ``sp / kv_heads`` times
    (so kv heads must divide sp): a rank's query heads then read exactly one kv head."""
    p = []
    if sp > 1 and heads % sp:
        p.append(f"parallel.sp={sp} does not divide {prefix}num_attention_heads={heads}: Ulysses sequence "
                 "parallelism gives each sp rank num_attention_heads / sp heads")
    elif sp > 1 and kv_heads % sp and sp % kv_heads:
        p.append(f"parallel.sp={sp} and {prefix}num_key_value_heads={kv_heads} (num_attention_heads={heads}): kv "
                 "heads must divide by sp, or divide sp (each then replicated sp / num_key_value_heads times)")
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
    return config_tree.load_config(path, overrides, cls)


def describe_keys(cls: type = Config, prefix: str = "") -> str:
    """Every key of the schema with its type, default and help (`scalerl config --keys`)."""
    return config_tree.describe_keys(cls, prefix)
