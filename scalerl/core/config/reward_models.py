"""The models that score rollouts, as `data` subsections: a reward model (`data.reward_model`) and a
generative judge (`data.judge`), with the judge's template and label checks its runtime shares
(`scalerl.data.rewards.judge`)."""

from __future__ import annotations

import string
from dataclasses import dataclass

from scalerl.core.config.model import DTYPES
from scalerl.core.config.tree import Section, _check, _check_choice, opt

JUDGE_SLOTS = ("prompt", "response", "ground_truth")  # data.judge.template's slots (scalerl/data/rewards/judge.py)
JUDGE_ENGINES = ("builtin", "vllm")  # data.judge.engine
PAIRWISE_JUDGE_SLOTS = ("prompt", "response_a", "response_b", "ground_truth")  # with data.judge.verdict=pairwise
JUDGE_VERDICTS = ("number", "label", "pairwise")
DEFAULT_JUDGE_TEMPLATE = ("Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
                          "Grade the response from 0 to 10.\nGrade:")  # data.judge.template's default


@dataclass
class RewardModelSection(Section):
    """A reward model scored on the trainer ranks (`scalerl.data.rewards.model`; verl's reward_model.*):
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


def judge_template_problems(template: str, key: str = "data.judge.template", verdict: str = "number") -> list[str]:
    """What is wrong with a judge template: a slot it does not know, no ``{response}`` (pairwise: no
    ``{response_a}`` or ``{response_b}``), a malformed brace."""
    known = PAIRWISE_JUDGE_SLOTS if verdict == "pairwise" else JUDGE_SLOTS
    listed = ", ".join("{" + s + "}" for s in known)
    try:
        slots = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as error:
        return [f"{key} is not a template ({error}); use {listed}, and double a literal brace ({{{{ or }}}})"]
    problems = []
    unknown = sorted(slots - set(known))
    if unknown:
        problems.append(f"{key} names {', '.join('{' + s + '}' for s in unknown)}; the slots are {listed}"
                        + (" (data.judge.verdict=pairwise)" if verdict == "pairwise" else ""))
    if verdict == "pairwise":
        for slot in ("response_a", "response_b"):
            if slot not in slots:
                problems.append(f"{key} has no {{{slot}}} slot: data.judge.verdict=pairwise shows the judge two "
                                "responses, {response_a} and {response_b}, and reads its choice, A or B")
    elif "response" not in slots:
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
class JudgeSection(Section):
    """A generative judge as the reward (data.reward=judge; `scalerl.data.rewards.judge`): a model prompted with a
    rubric scores each response, its verdict parsed (docs/configuration.md#generative-judges)."""

    name = "data.judge"
    model: str | None = opt(None, "the judge's model directory (any model scalerl loads); needed by data.reward=judge")
    tokenizer: str | None = opt(None, "its tokenizer directory; null = data.judge.model ('builtin' for a built-in one)")
    template: str = opt(DEFAULT_JUDGE_TEMPLATE, "the judge's prompt: {prompt}, {response} (required) and "
                                                "{ground_truth} are filled in")
    verdict: str = opt("number", "how its answer is read: number (the first number / data.judge.max_score) | label "
                                 "(the first of data.judge.labels found) | pairwise (A or B: which of two responses "
                                 "of a group is better; the score is the share of its comparisons won)")
    max_score: float = opt(10.0, "verdict=number: the grade that scores 1.0", above=0)
    labels: str = opt("correct=1,incorrect=0", "verdict=label: label=score pairs, matched as whole words")
    max_new_tokens: int = opt(16, "longest judge answer (greedy, so a response always gets the same verdict)",
                              at_least=1)
    batch_size: int = opt(16, "judge prompts per generation batch", at_least=1)
    chat_template: bool = opt(False, "send the judge prompt through its tokenizer's chat template (instruct judges)")
    dtype: str = opt("float32", "the judge's parameter dtype: " + " | ".join(DTYPES))
    engine: str = opt("builtin", "what the judge generates with: builtin (its model loaded by scalerl) | vllm (vLLM "
                                 "over data.judge.model; the vllm extra)")
    workers: int = opt(0, "judge worker processes, each loading the judge once; the rows of each part of a step's "
                          "generation go to them as the part arrives, so judging overlaps the rest of the "
                          "generation (0: the judge runs in the trainer's process, after each part)", at_least=0)
    parts: int = opt(2, "with data.judge.workers > 0 and colocated rollouts: the step's generation on each rank is "
                        "cut into this many parts of whole groups, each judged while the next generates (1: one "
                        "part, judged after it); standalone workers' replies are the parts there", at_least=1)

    def problems(self) -> list[str]:
        p: list[str] = judge_template_problems(self.template, verdict=self.verdict)
        _check_choice(p, "data.judge.engine", self.engine, JUDGE_ENGINES)
        _check_choice(p, "data.judge.verdict", self.verdict, JUDGE_VERDICTS)
        _check_choice(p, "data.judge.dtype", self.dtype, DTYPES)
        if self.verdict == "label":
            try:
                parse_judge_labels(self.labels)
            except ValueError as error:
                p.append(str(error))
        return p
