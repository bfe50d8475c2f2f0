"""A generative judge as the reward (``data.reward=judge``, ``data.judge.*``): a language model prompted with a
rubric scores each response; its verdict is parsed into a number.

The judge is any model directory scalerl loads (the built-in decoder or the transformers fallback). Its prompt
is ``data.judge.template`` with ``{prompt}``, ``{response}`` and ``{ground_truth}`` filled in (``{response}`` is
required: a judge that never sees the response scores nothing), encoded as prompts are (`encode_prompts`:
through the judge tokenizer's chat template with ``data.judge.chat_template``). It generates greedily
(temperature 0: the same response gets the same verdict, every run) at most ``data.judge.max_new_tokens``
tokens, in batches of ``data.judge.batch_size``, on ``data.judge.engine``: the built-in engine over the model
loaded on the trainer's device, or vLLM over the model directory (imported only then). With
``data.judge.workers=0`` it runs in the trainer's process, after each part of the step's generation; with N
workers it runs in a pool of its own processes that judge each part while the next generates
(`scalerl.data.rewards.judge_pool`), with the same verdicts.

Verdicts (``data.judge.verdict``):
    number   the first number in the judge's text, divided by ``data.judge.max_score`` (so "Score: 7" of 10
             is 0.7); a number outside [0, max_score] is not a verdict
    label    the first of ``data.judge.labels`` ("correct=1,incorrect=0") found in the text, as a whole word,
             case-insensitive; it scores the label's value
    pairwise a choice between two responses of the same prompt: the template shows ``{response_a}`` and
             ``{response_b}``, the verdict is the first capital "A" or "B" standing as a word ("A", "[[B]]",
             "Answer: A"). Within a group (consecutive samples of one prompt, as GRPO lays them out) every
             ordered pair is judged, each response as A against every other and as B against every other,
             so a judge that favours a position favours every response alike; a response's score is the share
             of its 2 (n - 1) comparisons it won. A response alone in its group has nothing to be compared
             with: it scores 0.5 and the judge is not called.

A text with no verdict is never a silent 0: the judge returns the raw text, which the reward computer counts
as a failure (``reward/num_failures``) and logs once per kind with the text, as any unusable reward value.
Pairwise, an unparseable comparison fails both responses it compared (their shares would be over fewer
comparisons than their group's others').
It is called as TRL's batched rewards are (``fn(prompts, completions, **columns)``), so it adds up with other
rewards (``data.reward=judge,file.py:fn``) and is checked against the rows like them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

# The checks `load_config` runs on data.judge live with the config (a lower layer).
from scalerl.core.config import DEFAULT_JUDGE_TEMPLATE, judge_template_problems, parse_judge_labels

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_CHOICE = re.compile(r"\b([AB])\b")  # pairwise: a capital A or B standing as a word


@dataclass(frozen=True)
class VerdictParser:
    """A judge's text -> its score, or None when the text holds no verdict."""

    kind: str = "number"
    max_score: float = 10.0
    labels: tuple[tuple[str, float], ...] = ()

    def __call__(self, text: str) -> float | None:
        if self.kind == "pairwise":  # 1.0: response A won, 0.0: B won
            choice = _CHOICE.search(text)
            return None if choice is None else float(choice.group(1) == "A")
        if self.kind == "number":
            match = _NUMBER.search(text)
            if match is None:
                return None
            value = float(match.group())
            return value / self.max_score if 0 <= value <= self.max_score else None
        found = [(m.start(), score) for label, score in self.labels
                 for m in [re.search(rf"\b{re.escape(label)}\b", text, re.IGNORECASE)] if m]
        return min(found)[1] if found else None  # the label the judge wrote first


class GenerativeJudge:
    """The judge as a batched (TRL-style) reward function: ``judge(prompts, completions, **columns)`` -> one
    score per completion, or the judge's raw text where it gave no verdict (a counted failure)."""

    __name__ = "judge"
    keeps_own_process = True  # its model is loaded here: data.reward_workers cannot import it by name

    def __init__(self, engine: Any, tokenizer: Any, template: str = DEFAULT_JUDGE_TEMPLATE,
                 parse: VerdictParser = VerdictParser(), max_new_tokens: int = 16, batch_size: int = 16,
                 chat_template: bool = False):
        problems = judge_template_problems(template, verdict=parse.kind)
        if problems:
            raise ValueError("; ".join(problems))
        self.engine, self.tokenizer, self.template, self.parse = engine, tokenizer, template, parse
        self.max_new_tokens, self.batch_size, self.chat_template = max_new_tokens, batch_size, chat_template
        self.last_texts: list[str] = []  # the judge's raw answers of the last call (tests, debugging)

    def prompt_text(self, prompt: Any, response: str, ground_truth: Any) -> str:
        if isinstance(prompt, list):  # chat messages: the conversation's text
            prompt = "\n".join(str(m.get("content", "")) for m in prompt)
        return self.template.format(prompt=prompt, response=response,
                                    ground_truth="" if ground_truth is None else ground_truth)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | str]:
        truths = columns.get("ground_truth") or [None] * len(prompts)
        responses = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        if self.parse.kind == "pairwise":
            return self._pairwise(prompts, responses, truths)
        answers = self._answers([self.prompt_text(p, r, g) for p, r, g in zip(prompts, responses, truths)])
        verdicts: list[float | str] = []
        for answer in answers:
            score = self.parse(answer)
            verdicts.append(score if score is not None else f"no verdict in the judge's answer {answer.strip()!r}")
        return verdicts

    def _answers(self, texts: list[str]) -> list[str]:
        """The judge's greedy answers to ``texts``, in batches of ``batch_size`` (kept in ``last_texts``)."""
        import torch

        from scalerl.data.prompts import encode_prompts
        from scalerl.rollout.engines.engine import SamplingParams

        sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0,
                                  stop_token_ids=self.tokenizer.stop_token_ids)
        answers: list[str] = []
        for start in range(0, len(texts), self.batch_size):
            ids = encode_prompts(self.tokenizer, texts[start : start + self.batch_size], self.chat_template)
            with torch.no_grad():
                out = self.engine.generate(ids, sampling)
            rows = [row[: int(n)] for row, n in zip(out.response_ids.tolist(), out.response_lengths.tolist())]
            answers.extend(self.tokenizer.batch_decode(rows))
        self.last_texts = answers
        return answers

    def _pairwise(self, prompts: Sequence[Any], responses: list[str], truths: Sequence[Any]) -> list[float | str]:
        """Each response's share of won comparisons within its group: every ordered pair (i as A, j as B) of
        the group's responses judged once, in one batched generation over the whole call."""
        groups, start = [], 0
        for i in range(1, len(prompts) + 1):  # a group: a run of consecutive samples of one prompt
            if i == len(prompts) or prompts[i] != prompts[start]:
                groups.append(range(start, i))
                start = i
        pairs = [(a, b) for group in groups for a in group for b in group if a != b]
        texts = []
        for a, b in pairs:
            prompt = prompts[a]
            if isinstance(prompt, list):  # chat messages: the conversation's text
                prompt = "\n".join(str(m.get("content", "")) for m in prompt)
            texts.append(self.template.format(prompt=prompt, response_a=responses[a], response_b=responses[b],
                                              ground_truth="" if truths[a] is None else truths[a]))
        answers = self._answers(texts) if texts else []
        wins, counted = [0.0] * len(prompts), [0] * len(prompts)
        failed: dict[int, str] = {}
        for (a, b), answer in zip(pairs, answers):
            a_won = self.parse(answer)
            if a_won is None:
                why = f"no verdict (A or B) in the judge's pairwise answer {answer.strip()!r}"
                failed.setdefault(a, why)
                failed.setdefault(b, why)
                continue
            wins[a] += a_won
            wins[b] += 1.0 - a_won
            counted[a] += 1
            counted[b] += 1
        return [failed[i] if i in failed else (wins[i] / counted[i] if counted[i] else 0.5)
                for i in range(len(prompts))]


def judge_from_config(data_cfg: Any, device: Any) -> GenerativeJudge:
    """The judge ``data.judge`` describes, its model loaded on ``device`` in eval mode (in this process)."""
    return judge_from_section(data_cfg.judge, device)


def judge_from_section(j: Any, device: Any) -> GenerativeJudge:
    """The judge of a ``data.judge`` section (or an object with its fields: a pool worker gets a copy), on the
    engine ``data.judge.engine`` names: the built-in one over the model loaded on ``device``, or vLLM over the
    model directory (its own weights and KV cache; imported only here, so a run without it never needs it)."""
    from scalerl.models.load import tokenizer_source

    labels = tuple(parse_judge_labels(j.labels).items()) if j.verdict == "label" else ()
    parse = VerdictParser(j.verdict, j.max_score, labels)
    # the judge's keys in the error where its directory has no tokenizer (either engine)
    source = tokenizer_source(j, j.model, "data.judge.model", "data.judge.tokenizer")
    if getattr(j, "engine", "builtin") == "vllm":
        from scalerl.models.tokenizer import load_tokenizer
        from scalerl.rollout.engines.vllm import VLLMEngine

        tokenizer = load_tokenizer(source)
        engine: Any = VLLMEngine(j.model, tokenizer.pad_token_id, dtype=VLLM_JUDGE_DTYPES[j.dtype],
                                 kv_cache_gib=getattr(j, "vllm_kv_cache_gib", 1.0))
    else:
        import torch

        from scalerl.core.config import ModelSection
        from scalerl.models.load import load_model_and_tokenizer
        from scalerl.rollout.engines.builtin import BuiltinEngine

        model_cfg = ModelSection(path=j.model, tokenizer=j.tokenizer, dtype=j.dtype)
        model, tokenizer = load_model_and_tokenizer(model_cfg, None, torch.device(device), 0)
        model.eval().requires_grad_(False)
        engine = BuiltinEngine(model, tokenizer.pad_token_id)
    return GenerativeJudge(engine, tokenizer, j.template, parse, j.max_new_tokens, j.batch_size, j.chat_template)


# data.judge.dtype (a torch dtype's name) -> the vLLM engine's precision names
VLLM_JUDGE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
