"""Chunked entropy_from_logits / logprobs_from_logits against the naive full-softmax versions."""

import pytest
import torch

from scalerl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from tests.algorithms import verl_reference as verl

TOL = dict(atol=1e-6, rtol=1e-6)


def logits_and_labels(seed: int, shape=(3, 5), vocab: int = 37, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(*shape, vocab, generator=gen)
    labels = torch.randint(0, vocab, shape, generator=gen)
    return logits, labels


@pytest.mark.parametrize("seed", [0, 1])
def test_entropy_matches_naive_value_and_gradient(seed):
    logits, _ = logits_and_labels(seed)
    ours_in, ref_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = entropy_from_logits(ours_in, chunk_size=4)
    ref = verl.entropy_from_logits(ref_in)
    torch.testing.assert_close(ours, ref, **TOL)
    (grad,) = torch.autograd.grad(ours.sum(), ours_in)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_in)
    torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_match_naive_value_and_gradient(seed):
    logits, labels = logits_and_labels(seed)
    ours_in, ref_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = logprobs_from_logits(ours_in, labels, chunk_size=4)
    ref = verl.logprobs_from_logits_naive(ref_in, labels)
    torch.testing.assert_close(ours, ref, **TOL)
    (grad,) = torch.autograd.grad(ours.sum(), ours_in)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_in)
    torch.testing.assert_close(grad, ref_grad, **TOL)


def test_chunk_size_does_not_change_results():
    logits, labels = logits_and_labels(2, shape=(4, 7))
    entropy = [entropy_from_logits(logits, chunk_size=c) for c in (1, 3, 5, 28, 1000)]
    logprobs = [logprobs_from_logits(logits, labels, chunk_size=c) for c in (1, 3, 5, 28, 1000)]
    assert all(torch.equal(e, entropy[0]) for e in entropy)
    assert all(torch.equal(lp, logprobs[0]) for lp in logprobs)
    assert entropy[0].shape == (4, 7) and logprobs[0].shape == (4, 7)


def test_large_logits_stay_finite():
    logits, labels = logits_and_labels(3, scale=1e4)
    entropy = entropy_from_logits(logits)
    logprobs = logprobs_from_logits(logits, labels)
    assert torch.isfinite(entropy).all() and (entropy >= -1e-4).all()
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()


def test_bf16_input_is_computed_in_float32():
    logits, labels = logits_and_labels(4)
    low = logits.to(torch.bfloat16)
    entropy = entropy_from_logits(low)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, verl.entropy_from_logits(low.float()), **TOL)
    torch.testing.assert_close(logprobs_from_logits(low, labels),
                               verl.logprobs_from_logits_naive(low.float(), labels), **TOL)
