"""On-policy distillation's per-token advantage and metrics against a hand computation, the top-k forward KL
against a hand computation and a dense reference (values and gradients), and the teacher's tokenizer check."""

import math

import pytest
import torch

from scalerl.algorithms.distillation import (
    check_teacher_tokenizer,
    combine_advantages,
    distill_advantages,
    split_teacher_outputs,
    teacher_token_outputs,
    topk_forward_kl,
)
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


# --- top-k (verl 0.9.1's forward_kl_topk) --------------------------------------------------------------------


def _topk(ids, logprobs):
    """The teacher pass's top-k columns: ids (as floats) then log-probs."""
    return torch.cat([torch.tensor(ids, dtype=torch.float32), torch.tensor(logprobs, dtype=torch.float32)], -1)


def test_topk_forward_kl_is_the_teachers_mass_weighted_gap_on_its_top_k_by_hand():
    student = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))  # logits: their softmax is these
    # token 0: teacher top-2 = ids 1, 0 at 0.5, 0.25; token 1: top-1 = id 2 at 0.2 (the student puts 0.7 there)
    teacher = torch.stack([_topk([1.0, 0.0], [math.log(0.5), math.log(0.25)]),
                           _topk([2.0, 2.0], [math.log(0.2), -math.inf])])
    kl = topk_forward_kl(student, teacher)
    # 0.5 (ln .5 - ln .25) + 0.25 (ln .25 - ln .5) = 0.25 ln 2; 0.2 (ln .2 - ln .7) < 0, clamped to 0 as verl does
    assert torch.allclose(kl, torch.tensor([0.25 * math.log(2), 0.0]), atol=1e-6)
    assert torch.allclose(topk_forward_kl(student, teacher, max_clamp=0.1), torch.tensor([0.1, 0.0]))


def _dense_reference(student_logits, teacher_logits, k):
    """The same KL written densely over the vocabulary: the teacher's probabilities kept on its top-k, zero
    elsewhere, against the student's full log-softmax, clamped at 0."""
    teacher = torch.log_softmax(teacher_logits, -1)
    keep = torch.zeros_like(teacher, dtype=torch.bool).scatter(-1, teacher.topk(k, -1).indices, True)
    p = torch.where(keep, teacher.exp(), torch.zeros_like(teacher))
    return (p * (teacher - torch.log_softmax(student_logits, -1))).sum(-1).clamp(min=0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_topk_forward_kl_and_its_gradient_equal_a_dense_reference_and_k_vocab_is_the_full_kl(k):
    gen = torch.Generator().manual_seed(0)
    student_logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    teacher_logits = 2 * torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    teacher = teacher_token_outputs(teacher_logits, torch.zeros(2, 5, dtype=torch.long), k)
    assert teacher.shape == (2, 5, 1 + 2 * k)  # the pass keeps [B, R, 1 + 2k], never [B, R, V]
    weights = torch.rand(2, 5, generator=gen, dtype=torch.float64)

    ours = student_logits.clone().requires_grad_(True)
    value = topk_forward_kl(ours, teacher[..., 1:].double())
    (value * weights).sum().backward()
    dense = student_logits.clone().requires_grad_(True)
    expected = _dense_reference(dense, teacher_logits, k)
    (expected * weights).sum().backward()
    assert torch.allclose(value, expected.detach(), atol=1e-6)
    assert torch.allclose(ours.grad, dense.grad, atol=1e-6)
    assert ours.grad.abs().sum() > 0
    if k == 7:  # the whole vocabulary: the forward KL(teacher || student)
        full = torch.nn.functional.kl_div(torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1),
                                          reduction="none", log_target=True).sum(-1)
        assert torch.allclose(value.detach(), full, atol=1e-6)


def test_teacher_outputs_hold_the_sampled_tokens_log_prob_then_the_top_k_and_split_back():
    logits = torch.log(torch.tensor([[[0.1, 0.6, 0.3]]]))
    out = teacher_token_outputs(logits, torch.tensor([[2]]), 2)
    assert torch.allclose(out, torch.tensor([[[math.log(0.3), 1.0, 2.0, math.log(0.6), math.log(0.3)]]]), atol=1e-6)
    logprobs, topk = split_teacher_outputs(out, 2)
    assert logprobs.shape == (1, 1) and topk.shape == (1, 1, 4)
    with pytest.raises(ConfigError, match=r"algorithm.distill.top_k=4 is more than the teacher's vocabulary of 3"):
        teacher_token_outputs(logits, torch.tensor([[2]]), 4)


def test_a_teacher_top_k_id_past_the_students_vocabulary_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"algorithm.distill.top_k: the teacher's top-k holds token id 5, past the "
                                          r"student's vocabulary of 3: use a teacher with the student's vocabulary"):
        topk_forward_kl(torch.zeros(1, 3), _topk([5.0], [-0.1]).view(1, 2))


def test_rows_without_a_teacher_get_no_advantage_and_stay_out_of_the_metrics():
    student, teacher = torch.zeros(2, 2), torch.tensor([[-1.0, -1.0], [-5.0, -5.0]])
    mask = torch.ones(2, 2)
    advantages, metrics = distill_advantages(teacher, student, mask, 1.0, distilled=torch.tensor([True, False]))
    assert torch.equal(advantages, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))
    assert metrics["distill/reverse_kl"] == pytest.approx(1.0)  # row 0's alone
    assert metrics["distill/distilled_rows"] == pytest.approx(0.5)
    topk = _topk([[[0.0], [0.0]], [[0.0], [0.0]]], [[[math.log(0.5)], [math.log(0.25)]], [[-1.0], [-1.0]]])
    _, with_mass = distill_advantages(teacher, student, mask, 1.0, distilled=torch.tensor([True, False]),
                                      teacher_topk=topk)
    assert with_mass["distill/teacher_mass"] == pytest.approx(0.375)  # (0.5 + 0.25) / 2, row 0's tokens
