"""The `data` section: the task or data files, their format and columns, the prompt, and the reward
(`data.reward` and its workers, servers and weights; the reward model and the judge are in
`scalerl.core.config.reward_models`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scalerl.core.config.reward_models import JudgeSection, RewardModelSection
from scalerl.core.config.tree import Section, _check, _check_choice, opt

TASKS = ("arithmetic", "gsm8k", "math", "tool_arithmetic")
DATA_FORMATS = ("auto", "gsm8k", "math", "rows", "verl", "trl")
BUILTIN_REWARDS = ("auto", "gsm8k", "math", "none", "judge")  # none: data.reward_model alone; judge: data.judge


@dataclass
class DataSection(Section):
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
