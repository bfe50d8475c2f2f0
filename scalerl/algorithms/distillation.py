"""On-policy distillation: the student samples, a teacher scores the student's own tokens, and each token's
advantage is the negative reverse KL on it, ``coef * (log p_teacher(y_t) - log p_student(y_t))`` (Agarwal et al.,
arXiv 2306.13649; Thinking Machines' "On-Policy Distillation"; verl's OPD recipe: ``advantage = teacher_log_prob -
student_log_prob``, trained with the policy loss's importance ratio). Its expectation over the student's samples
is the per-token reverse KL(student || teacher), mode-seeking, so the student is pulled toward what the teacher
would say where the student actually goes. No discounting: each token answers for itself, the dense signal
that makes distillation need far fewer samples than a sequence-level reward.

With a task reward as well, the step's advantage is ``task_weight * A_task + A_distill`` (``algorithm.distill``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from scalerl.algorithms.kl import kl_estimate
from scalerl.core.config_tree import ConfigError

# Texts both tokenizers must cut alike: letters, digits, arithmetic, the prompt template's words, whitespace.
TOKENIZER_PROBES = ("Question: What is 12 + 345?\nAnswer: 357", "The quick brown fox jumps over the lazy dog.",
                    " 0123456789 +-*/=()[]{}<>,.;:!?'\"\n")


def distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor,
                       coef: float, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       estimator: str = "k1", max_clamp: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages ``-coef * k(student, teacher) * mask`` ``[B, T]``, ``k`` the per-token KL estimator
    ``estimator`` (`scalerl.algorithms.kl.kl_estimate`; ``k1``: ``student - teacher``, so the advantage is
    ``coef * (teacher - student)``), clamped to ``[-max_clamp, max_clamp]`` where given (verl's
    ``loss_max_clamp``); no gradient: the log-probs are the sampling policy's and the frozen teacher's. And
    ``distill/*`` metrics over every rank's tokens (``all_reduce`` sums over data-parallel ranks, so DP=2 reports
    what one process would): ``reverse_kl`` the mean of ``student - teacher`` (the sampled estimate of
    KL(student || teacher)), ``teacher_logprob`` the teacher's mean log-prob of the student's tokens,
    ``advantage`` the mean advantage."""
    mask = mask.to(student_logprobs.dtype)
    gap = (teacher_logprobs - student_logprobs).detach()
    per_token = kl_estimate(student_logprobs.detach(), teacher_logprobs.detach(), estimator)
    if max_clamp is not None:
        per_token = per_token.clamp(-max_clamp, max_clamp)
    advantages = -coef * per_token * mask
    sums = torch.stack([(-gap * mask).sum(), (teacher_logprobs * mask).sum(), advantages.sum(), mask.sum()])
    sums = sums.double()
    if all_reduce is not None:
        sums = all_reduce(sums)
    count = max(float(sums[3]), 1.0)
    metrics = {"distill/reverse_kl": float(sums[0]) / count, "distill/teacher_logprob": float(sums[1]) / count,
               "distill/advantage/mean": float(sums[2]) / count}
    return advantages, metrics


def combine_advantages(task_advantages: torch.Tensor, distill: torch.Tensor, task_weight: float) -> torch.Tensor:
    """The step's advantages: the task estimator's weighted by ``task_weight`` (0: distillation alone) plus the
    distillation's, token by token."""
    if task_weight == 0:
        return distill
    return task_weight * task_advantages + distill


def check_teacher_tokenizer(student: Any, teacher: Any, teacher_path: str,
                            probes: Sequence[str] = TOKENIZER_PROBES) -> None:
    """The teacher must read the student's token ids as the same text: its log-probs are of the student's
    tokens. Refuses another vocabulary size or any probe text cut differently, naming the key and the fix."""
    def fix(why: str) -> ConfigError:
        return ConfigError(f"algorithm.distill.teacher={teacher_path!r} has another tokenizer than the student "
                           f"({why}); its log-probs would be of other tokens: use a teacher of the student's "
                           "family (the same tokenizer), or set model.tokenizer to the tokenizer both share")

    if student.vocab_size != teacher.vocab_size:
        raise fix(f"vocabulary {teacher.vocab_size} vs the student's {student.vocab_size}")
    for text in probes:
        theirs, ours = teacher.encode(text), student.encode(text)
        if list(theirs) != list(ours):
            raise fix(f"{text!r} is {list(theirs)[:8]}... for the teacher, {list(ours)[:8]}... for the student")


def load_teacher(cfg: Any, student_tokenizer: Any, device: torch.device) -> torch.nn.Module:
    """On-policy distillation's teacher (``algorithm.distill.teacher``), frozen, checked to read the student's
    token ids as the same text. Its tokenizer is its own directory's, else ``model.tokenizer``."""
    # The loader's imports only where a teacher is loaded.
    from scalerl.models.load import load_model_and_tokenizer

    path = cfg.algorithm.distill.teacher
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"algorithm.distill.teacher={path!r} is not a model directory (no config.json there): give "
                          "a directory a run exported (its final/ or sft/model/) or a Hugging Face model directory")
    own_tokenizer = (Path(path) / "tokenizer.json").is_file()
    teacher_cfg = dataclasses.replace(cfg.model, path=path, tokenizer=None if own_tokenizer else cfg.model.tokenizer)
    teacher, tokenizer = load_model_and_tokenizer(teacher_cfg, None, device, cfg.trainer.seed)
    check_teacher_tokenizer(student_tokenizer, tokenizer, path)
    return teacher.requires_grad_(False)
