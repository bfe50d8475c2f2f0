"""On-policy distillation: the student samples, a teacher scores the student's own tokens, and each token's
advantage is the negative reverse KL on it, ``coef * (log p_teacher(y_t) - log p_student(y_t))`` (Agarwal et al.,
arXiv 2306.13649; Thinking Machines' "On-Policy Distillation"; verl's OPD recipe: ``advantage = teacher_log_prob -
student_log_prob``, trained with the policy loss's importance ratio). Its expectation over the student's samples
is the per-token reverse KL(student || teacher), mode-seeking, so the student is pulled toward what the teacher
would say where the student actually goes. No discounting: each token answers for itself, the dense signal
that makes distillation need far fewer samples than a sequence-level reward.

With a task reward as well, the step's advantage is ``task_weight * A_task + A_distill`` (``algorithm.distill``).

Top-k (``algorithm.distill.top_k = k > 0``): the teacher's pass keeps, per response token, its ``k`` likeliest
ids and their log-probs (``[B, R, k]`` each, never ``[B, R, V]``), and the student is trained on verl 0.9.1's
``forward_kl_topk``: ``sum_{i in teacher top-k} p_T(i) (log p_T(i) - log p_S(i))`` with both log-probs the full
vocabulary's (not renormalised over the k ids), clamped at 0 below, differentiated through the student's logits
as a loss term (verl's ``use_policy_gradient=false``; as an advantage it would not depend on the sampled token,
so its policy gradient would be zero in expectation). ``k = V`` is the full forward KL(teacher || student).

Several teachers (``algorithm.distill.teachers``: data source -> model directory): each row is scored by its
source's teacher, one model per distinct directory (`Teachers`); a row whose source has none gets no
distillation term.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from scalerl.algorithms.kl import kl_estimate
from scalerl.core.config.tree import ConfigError

# Texts both tokenizers must cut alike: letters, digits, arithmetic, the prompt template's words, whitespace.
TOKENIZER_PROBES = ("Question: What is 12 + 345?\nAnswer: 357", "The quick brown fox jumps over the lazy dog.",
                    " 0123456789 +-*/=()[]{}<>,.;:!?'\"\n")


def distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor,
                       coef: float, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       estimator: str = "k1", max_clamp: float | None = None, distilled: torch.Tensor | None = None,
                       teacher_topk: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages ``-coef * k(student, teacher) * mask`` ``[B, T]``, ``k`` the per-token KL estimator
    ``estimator`` (`scalerl.algorithms.kl.kl_estimate`; ``k1``: ``student - teacher``, so the advantage is
    ``coef * (teacher - student)``), clamped to ``[-max_clamp, max_clamp]`` where given (verl's
    ``loss_max_clamp``); no gradient: the log-probs are the sampling policy's and the frozen teacher's. And
    ``distill/*`` metrics over every rank's tokens (``all_reduce`` sums over data-parallel ranks, so DP=2 reports
    what one process would): ``reverse_kl`` the mean of ``student - teacher`` (the sampled estimate of
    KL(student || teacher)), ``teacher_logprob`` the teacher's mean log-prob of the student's tokens,
    ``advantage`` the mean advantage, ``distilled_rows`` the share of rows with a teacher.

    ``distilled`` ``[B]`` bool: the rows with a teacher (several teachers by data source); the others get a zero
    advantage and stay out of the metrics. ``teacher_topk`` ``[B, R, 2k]`` (`split_teacher_outputs`) adds
    ``distill/teacher_mass``, the teacher's probability mass on its top-k tokens (verl's
    ``distillation/teacher_mass``)."""
    mask = mask.to(student_logprobs.dtype)
    rows = mask.new_ones(mask.shape[0]) if distilled is None else distilled.to(mask.device, mask.dtype)
    mask = mask * rows[:, None]
    gap = (teacher_logprobs - student_logprobs).detach()
    per_token = kl_estimate(student_logprobs.detach(), teacher_logprobs.detach(), estimator)
    if max_clamp is not None:
        per_token = per_token.clamp(-max_clamp, max_clamp)
    advantages = -coef * per_token * mask
    mass = teacher_topk[..., teacher_topk.shape[-1] // 2 :].exp().sum(-1) if teacher_topk is not None else mask
    sums = torch.stack([(-gap * mask).sum(), (teacher_logprobs * mask).sum(), advantages.sum(), mask.sum(),
                        (mass * mask).sum(), rows.sum(), rows.new_tensor(float(len(rows)))])
    sums = sums.double()
    if all_reduce is not None:
        sums = all_reduce(sums)
    count = max(float(sums[3]), 1.0)
    metrics = {"distill/reverse_kl": float(sums[0]) / count, "distill/teacher_logprob": float(sums[1]) / count,
               "distill/advantage/mean": float(sums[2]) / count,
               "distill/distilled_rows": float(sums[5]) / max(float(sums[6]), 1.0)}
    if teacher_topk is not None:
        metrics["distill/teacher_mass"] = float(sums[4]) / count
    return advantages, metrics


# Top-k ids travel as float32 beside the log-probs (one tensor per token, as the passes return them): exact
# below 2**24, far above any vocabulary.
_EXACT_FLOAT_IDS = 2**24


def teacher_token_outputs(logits: torch.Tensor, ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """The teacher's pass per response token, from its float32 logits ``[..., V]`` (already at the sampling
    temperature) and the sampled ids ``[...]``: ``[..., 1 + 2k]``, the sampled token's log-prob, then the ids of
    its ``k`` likeliest tokens (as floats), then their log-probs (the full vocabulary's log-softmax)."""
    if logits.shape[-1] > _EXACT_FLOAT_IDS:
        raise ValueError(f"algorithm.distill.top_k: a vocabulary of {logits.shape[-1]} tokens is past the ids "
                         f"float32 carries exactly ({_EXACT_FLOAT_IDS}); use top_k=0")
    if top_k > logits.shape[-1]:
        raise ConfigError(f"algorithm.distill.top_k={top_k} is more than the teacher's vocabulary of "
                          f"{logits.shape[-1]} tokens: use at most {logits.shape[-1]}")
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # fp32 at least
    top = logp.topk(top_k, dim=-1)
    return torch.cat([logp.gather(-1, ids.long().unsqueeze(-1)), top.indices.float(), top.values], dim=-1)


def split_teacher_outputs(values: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher pass's result as ``(teacher_logprobs [B, R], teacher_topk [B, R, 2k] or None)``: ``[B, R]`` is
    the sampled-token pass (top_k=0) as it is."""
    if top_k == 0:
        return values, None
    return values[..., 0], values[..., 1:]


def topk_forward_kl(student_logits: torch.Tensor, teacher_topk: torch.Tensor,
                    max_clamp: float | None = None) -> torch.Tensor:
    """verl 0.9.1's ``forward_kl_topk`` per token: ``sum_i p_T(i) (log p_T(i) - log p_S(i))`` over the teacher's
    top-k ids ``i``, ``log p_S`` the student's full-vocabulary log-softmax of ``student_logits [..., V]``
    gathered there (not renormalised over the k), ``teacher_topk [..., 2k]`` (ids then log-probs, as
    `teacher_token_outputs` writes them). Clamped at 0 below (outside the full vocabulary the sum can be
    negative: verl does the same), then to ``max_clamp`` above. Differentiable in ``student_logits``. A token
    whose teacher log-probs are all ``-inf`` (a row without a teacher) contributes 0."""
    k = teacher_topk.shape[-1] // 2
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # fp32 at least
    ids, teacher = teacher_topk[..., :k].long(), teacher_topk[..., k:].to(dtype)
    vocab = student_logits.shape[-1]
    if k and ids.numel() and int(ids.max()) >= vocab:  # a sequence shard may hold no response position
        raise ConfigError(f"algorithm.distill.top_k: the teacher's top-k holds token id {int(ids.max())}, past the "
                          f"student's vocabulary of {vocab}: use a teacher with the student's vocabulary size, or "
                          "top_k=0 (the sampled tokens' reverse KL)")
    student = torch.log_softmax(student_logits.to(dtype), dim=-1).gather(-1, ids)
    p = teacher.exp()
    finite = teacher.clamp(min=torch.finfo(teacher.dtype).min)  # -inf * 0 would be NaN
    kl = torch.where(p > 0, p * (finite - student), torch.zeros_like(student)).sum(-1).clamp(min=0.0)
    return kl if max_clamp is None else kl.clamp(max=max_clamp)


def combine_advantages(task_advantages: torch.Tensor, distill: torch.Tensor, task_weight: float) -> torch.Tensor:
    """The step's advantages: the task estimator's weighted by ``task_weight`` (0: distillation alone) plus the
    distillation's, token by token."""
    if task_weight == 0:
        return distill
    return task_weight * task_advantages + distill


def check_teacher_tokenizer(student: Any, teacher: Any, teacher_path: str,
                            probes: Sequence[str] = TOKENIZER_PROBES, key: str = "algorithm.distill.teacher") -> None:
    """The teacher must read the student's token ids as the same text: its log-probs are of the student's
    tokens. Refuses another vocabulary size or any probe text cut differently, naming the key and the fix."""
    def fix(why: str) -> ConfigError:
        return ConfigError(f"{key}={teacher_path!r} has another tokenizer than the student "
                           f"({why}); its log-probs would be of other tokens: use a teacher of the student's "
                           "family (the same tokenizer), or set model.tokenizer to the tokenizer both share")

    if student.vocab_size != teacher.vocab_size:
        raise fix(f"vocabulary {teacher.vocab_size} vs the student's {student.vocab_size}")
    for text in probes:
        theirs, ours = teacher.encode(text), student.encode(text)
        if list(theirs) != list(ours):
            raise fix(f"{text!r} is {list(theirs)[:8]}... for the teacher, {list(ours)[:8]}... for the student")


def teacher_paths(distill: Any) -> dict[str, str]:
    """Each teacher directory of ``algorithm.distill`` and the key that names it (for errors): the one
    ``teacher``, or the ``teachers`` mapping's distinct directories (one model per directory)."""
    if distill.teacher:
        return {distill.teacher: "algorithm.distill.teacher"}
    paths: dict[str, str] = {}
    for source, path in (distill.teachers or {}).items():
        paths.setdefault(path, f"algorithm.distill.teachers.{source}")
    return paths


def _output_vocab(model: Any) -> int | None:
    return getattr(getattr(model, "config", None), "vocab_size", None)


def load_teacher(cfg: Any, student_tokenizer: Any, device: torch.device, path: str | None = None,
                 key: str = "algorithm.distill.teacher", student: Any = None) -> torch.nn.Module:
    """On-policy distillation's teacher at ``path`` (default ``algorithm.distill.teacher``; ``key`` names it in
    errors), frozen, checked to read the student's token ids as the same text and, with top-k, to predict over
    the student's vocabulary (``student``'s output size). Its tokenizer is its own directory's, else
    ``model.tokenizer``."""
    # The loader's imports only where a teacher is loaded.
    from scalerl.models.load import load_model_and_tokenizer

    path = cfg.algorithm.distill.teacher if path is None else path
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{key}={path!r} is not a model directory (no config.json there): give "
                          "a directory a run exported (its final/ or sft/model/) or a Hugging Face model directory")
    own_tokenizer = (Path(path) / "tokenizer.json").is_file()
    teacher_cfg = dataclasses.replace(cfg.model, path=path, tokenizer=None if own_tokenizer else cfg.model.tokenizer)
    teacher, tokenizer = load_model_and_tokenizer(teacher_cfg, None, device, cfg.trainer.seed)
    check_teacher_tokenizer(student_tokenizer, tokenizer, path, key=key)
    top_k = cfg.algorithm.distill.top_k
    theirs, ours = _output_vocab(teacher), _output_vocab(student) if student is not None else None
    if top_k and theirs is not None and ours is not None and theirs != ours:
        raise ConfigError(f"algorithm.distill.top_k={top_k} compares the teacher's and the student's distributions "
                          f"token by token, but {key}={path!r} predicts over {theirs} tokens and the student over "
                          f"{ours} (the same tokenizer, another padded vocabulary): use a teacher with the "
                          "student's vocabulary size, or algorithm.distill.top_k=0 (the sampled tokens' reverse KL)")
    return teacher.requires_grad_(False)


def load_teachers(cfg: Any, student_tokenizer: Any, device: torch.device,
                  student: Any = None) -> dict[str, torch.nn.Module]:
    """Every teacher of ``algorithm.distill`` by directory (`teacher_paths`), each loaded once (`load_teacher`);
    empty when distillation is off."""
    return {path: load_teacher(cfg, student_tokenizer, device, path, key, student)
            for path, key in teacher_paths(cfg.algorithm.distill).items()}


class Teachers:
    """The run's teachers, laid out (each with its module at ``.model``), and which one scores each row.

    ``by_path``: directory -> laid-out teacher. ``by_source``: data source -> directory, empty when one
    teacher scores every row (``algorithm.distill.teacher``). A row's data source is its ``data_source``
    column, else ``default_source`` (the task's name), as sampled evaluation groups rows."""

    def __init__(self, by_path: dict[str, Any], by_source: dict[str, str] | None = None,
                 default_source: str = "", top_k: int = 0):
        if not by_path:
            raise ValueError("Teachers needs at least one teacher")
        self.by_path, self.by_source = by_path, dict(by_source or {})
        self.default_source, self.top_k = default_source, top_k
        self._checked_sources = False

    @property
    def single(self) -> bool:
        """One teacher for every row: its pass streams per part like the reference's."""
        return not self.by_source

    @property
    def model(self) -> torch.nn.Module:
        """The one teacher's module (``algorithm.distill.teacher``)."""
        if not self.single:
            raise ValueError("several teachers (algorithm.distill.teachers): score rows with Teachers.score")
        return next(iter(self.by_path.values())).model

    def eval(self) -> "Teachers":
        for parts in self.by_path.values():
            parts.eval()
        return self

    def sources(self, rows: Sequence[dict], n: int) -> list[str]:
        """Each sample's data source: ``rows`` one per group of ``n`` samples."""
        return [row.get("data_source") or self.default_source for row in rows for _ in range(n)]

    def score(self, batch: Any, sources: Sequence[str] | None,
              forward: Callable[[torch.nn.Module, Any], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward(teacher module, rows)`` over ``batch`` (a `RolloutBatch`), each row by its source's teacher,
        back in the batch's row order; and which rows had a teacher (``[B]`` bool; None: all, one teacher). A
        row without a teacher gets zeros, and ``-inf`` top-k log-probs (no top-k term). The first call warns
        about a mapped source no row of the batch has (a misspelt source would silently distil nothing)."""
        if self.single:
            return forward(self.model, batch), None
        if sources is None or len(sources) != len(batch):
            raise ValueError(f"several teachers need each row's data source ({len(batch)} rows, "
                             f"{0 if sources is None else len(sources)} sources)")
        if not self._checked_sources:
            self._checked_sources = True
            missing = sorted(set(self.by_source) - set(sources))
            if missing:
                warnings.warn(f"algorithm.distill.teachers names data source(s) {missing}, which no row of the first "
                              f"batch has (its sources: {sorted(set(sources))}): check the names against the data's "
                              "data_source column; rows of a source without a teacher get no distillation term",
                              stacklevel=2)
        device = batch.response_mask.device
        distilled = torch.tensor([s in self.by_source for s in sources], dtype=torch.bool, device=device)
        out: torch.Tensor | None = None
        for path, parts in self.by_path.items():
            rows = torch.tensor([i for i, s in enumerate(sources) if self.by_source.get(s) == path],
                                dtype=torch.long, device=device)
            if len(rows) == 0:
                continue
            values = forward(parts.model, batch.select(rows))
            if out is None:
                out = values.new_zeros((len(batch), *values.shape[1:]))
                if self.top_k:  # rows without a teacher: no top-k mass, so no top-k term
                    out[..., 1 + self.top_k :] = float("-inf")
            out[rows] = values
        if out is None:  # no row of this batch has a teacher: the shape of a pass, all off
            width = batch.response_mask.shape[1]
            out = torch.zeros(len(batch), width, *((1 + 2 * self.top_k,) if self.top_k else ()), device=device)
            if self.top_k:
                out[..., 1 + self.top_k :] = float("-inf")
        return out, distilled
