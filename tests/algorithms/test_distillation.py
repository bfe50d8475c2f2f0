"""On-policy distillation's per-token advantage and metrics against a hand computation, and the teacher's
tokenizer check."""

import math

import pytest
import torch

from scalerl.algorithms.distillation import check_teacher_tokenizer, combine_advantages, distill_advantages
from scalerl.core.config import ConfigError
from scalerl.models.tokenizer import CharTokenizer


def test_the_advantage_is_the_negative_reverse_kl_on_each_sampled_token():
    student = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.9, 0.3]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.4, 0.3, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages, metrics = distill_advantages(teacher, student, mask, coef=2.0)
    expected = 2.0 * torch.tensor([[math.log(0.5), math.log(2.0), 0.0], [math.log(2.0), math.log(1 / 3), 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    # the sampled reverse KL: mean over the five counted tokens of log student - log teacher
    kl = (math.log(2) - math.log(2) - math.log(2) + math.log(3)) / 5
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, abs=1e-6)
    assert metrics["distill/advantage/mean"] == pytest.approx(-2 * kl, abs=1e-6)
    teacher_mean = (math.log(0.25) + math.log(0.5) + math.log(0.4) + math.log(0.3) + math.log(0.3)) / 5
    assert metrics["distill/teacher_logprob"] == pytest.approx(teacher_mean, abs=1e-6)


def test_metrics_are_over_every_ranks_tokens():
    """With an all-reduce the metrics are the whole batch's, as one process would report them: rank 0 holds
    row 0, and the all-reduce adds rank 1's sums (row 1's, computed alone) to its own."""
    student, teacher = torch.zeros(2, 3), -torch.arange(6.0).view(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    _, whole = distill_advantages(teacher, student, mask, 1.0)
    rank1_sums = []
    distill_advantages(teacher[1:], student[1:], mask[1:], 1.0, lambda sums: rank1_sums.append(sums) or sums)
    _, reduced = distill_advantages(teacher[:1], student[:1], mask[:1], 1.0, lambda sums: sums + rank1_sums[0])
    assert reduced == pytest.approx(whole)
    _, alone = distill_advantages(teacher[:1], student[:1], mask[:1], 1.0)
    assert alone["distill/reverse_kl"] != pytest.approx(whole["distill/reverse_kl"])  # a rank alone differs


def test_with_a_task_weight_the_task_advantage_is_added():
    task, distill = torch.ones(1, 2), torch.tensor([[0.5, -1.0]])
    assert torch.equal(combine_advantages(task, distill, 0.0), distill)
    assert torch.equal(combine_advantages(task, distill, 0.5), torch.tensor([[1.0, -0.5]]))


def test_a_teacher_tokenizer_that_cuts_text_otherwise_is_refused():
    class Shifted(CharTokenizer):
        def encode(self, text):
            return [i + 1 for i in super().encode(text)]

    check_teacher_tokenizer(CharTokenizer(), CharTokenizer(), "t")  # the same: accepted
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher='t' has another tokenizer than the student "
                                          r"\('Question: What is 12 \+ 345\?\\nAnswer: 357' is \[53, 89, "):
        check_teacher_tokenizer(CharTokenizer(), Shifted(), "t")


def test_other_estimators_and_the_clamp_are_verls_kl_penalty_negated():
    student, teacher = torch.tensor([[-1.0, -3.0, -0.5]]), torch.tensor([[-2.0, -0.5, -0.5]])
    mask = torch.ones(1, 3)
    d = student - teacher  # log student - log teacher: [1, -2.5, 0]
    k3 = torch.exp(-d) + d - 1
    advantages, _ = distill_advantages(teacher, student, mask, 1.0, estimator="k3")
    assert torch.allclose(advantages, -k3)
    k2, _ = distill_advantages(teacher, student, mask, 2.0, estimator="k2")
    assert torch.allclose(k2, -2.0 * 0.5 * d.square())
    clamped, _ = distill_advantages(teacher, student, mask, 1.0, max_clamp=2.0)
    assert torch.allclose(clamped, torch.tensor([[-1.0, 2.0, 0.0]]))
