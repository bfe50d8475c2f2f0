"""The built-in KV-cache engine: log-prob consistency, stopping, sampling options, determinism."""

import pytest
import torch

from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.engines.sampling import filter_top_k_top_p
from tests.tiny import tiny_model

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def model():
    return tiny_model(hidden_size=64, intermediate_size=112).eval()


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 2, 7)]


def _full_forward_logprobs(model, out, temperature):
    ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.response_mask], dim=1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).float()
    p = out.prompt_ids.shape[1]
    logits = logits[:, p - 1 : -1] / (temperature or 1.0)
    return logits.log_softmax(-1).gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
    SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20, seed=2),
    SamplingParams(max_new_tokens=12, temperature=0.0),
])
def test_logprobs_equal_full_forward(model, sampling):
    out = BuiltinEngine(model, PAD).generate(_prompts(), sampling)
    ref = _full_forward_logprobs(model, out, sampling.temperature)
    m = out.response_mask.bool()
    assert (out.logprobs[m] - ref[m]).abs().max().item() < 1e-5


def test_greedy_matches_argmax_of_full_forward(model):
    out = BuiltinEngine(model, PAD).generate(_prompts(), SamplingParams(max_new_tokens=8, temperature=0))
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
    p = out.prompt_ids.shape[1]
    assert torch.equal(logits[:, p - 1 : -1].argmax(-1), out.response_ids)


@pytest.mark.parametrize("temperature", [1e-45, 1e-6])  # logits / 1e-45 overflows float32: NaN probabilities
def test_a_temperature_too_small_to_sample_at_decodes_greedily(model, temperature):
    """The tokens and log-probs of temperature 0, decided once per request (`SamplingParams`), for the fixed
    batch and through continuous batching."""
    assert SamplingParams(temperature=temperature).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # vLLM's line: at and above it, sampled
    for engine in (BuiltinEngine(model, PAD), BuiltinEngine(model, PAD, max_num_seqs=2)):
        greedy = engine.generate(_prompts(), SamplingParams(max_new_tokens=8, temperature=0))
        tiny = engine.generate(_prompts(), SamplingParams(max_new_tokens=8, temperature=temperature, seed=1))
        assert torch.equal(tiny.response_ids, greedy.response_ids)
        assert torch.equal(tiny.logprobs, greedy.logprobs)


def test_seeded_runs_repeat_and_seeds_differ(model):
    engine = BuiltinEngine(model, PAD)
    a = engine.generate(_prompts(), SamplingParams(max_new_tokens=10, seed=7))
    b = engine.generate(_prompts(), SamplingParams(max_new_tokens=10, seed=7))
    c = engine.generate(_prompts(), SamplingParams(max_new_tokens=10, seed=8))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_stop_tokens_finish_sequences_early(model):
    engine = BuiltinEngine(model, PAD)
    free = engine.generate(_prompts(), SamplingParams(max_new_tokens=10, temperature=0))
    stop = int(free.response_ids[1, 3])  # force row 1 to stop at its 4th token
    out = engine.generate(_prompts(), SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[stop]))
    assert out.finish_reasons[1] == "stop"
    first = int((out.response_ids[1] == stop).nonzero()[0])
    assert out.response_mask[1, : first + 1].all() and not out.response_mask[1, first + 1 :].any()
    assert (out.response_ids[1, first + 1 :] == PAD).all()
    assert (out.logprobs[1, first + 1 :] == 0).all()
    for i, reason in enumerate(out.finish_reasons):
        if reason == "length":
            assert out.response_mask[i].sum() == out.response_ids.shape[1]


def test_all_stopped_ends_loop(model):
    engine = BuiltinEngine(model, PAD)
    out = engine.generate(_prompts(), SamplingParams(max_new_tokens=20, seed=0, stop_token_ids=list(range(64))))
    assert out.response_ids.shape[1] == 1 and out.finish_reasons == ["stop"] * 4


def test_single_prompt_matches_batched(model):
    engine = BuiltinEngine(model, PAD)
    prompts = _prompts()
    batched = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    alone = engine.generate(prompts[2:3], SamplingParams(max_new_tokens=6, temperature=0))
    assert torch.equal(batched.response_ids[2], alone.response_ids[0])


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    # nucleus 0.8: 0.5 + 0.3 reaches 0.8, so the third token is dropped
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.01)).tolist() == [[False, True, True, True]]


def test_sampled_tokens_respect_top_k(model):
    out = BuiltinEngine(model, PAD).generate(_prompts() * 4, SamplingParams(max_new_tokens=1, top_k=1, seed=3))
    greedy = BuiltinEngine(model, PAD).generate(_prompts() * 4, SamplingParams(max_new_tokens=1, temperature=0))
    assert torch.equal(out.response_ids, greedy.response_ids)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_sampling_frequencies_follow_probabilities():
    from scalerl.rollout.engines.sampling import sample_tokens

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log().expand(20000, -1).contiguous()
    tokens, logprobs = sample_tokens(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert freq[1] == 0  # a zero-probability token is never drawn
    assert (freq - probs).abs().max() < 0.015
    assert torch.allclose(logprobs, probs.log()[tokens])


def test_engines_declare_their_capabilities():
    from scalerl.rollout.engines.vllm import VLLMEngine

    assert BuiltinEngine.logprobs_match_training_forward and BuiltinEngine.shares_trainer_weights
    assert not VLLMEngine.logprobs_match_training_forward and not VLLMEngine.shares_trainer_weights


def _sharp_model(std: float):
    """A tiny model with peaked distributions (init std ``std``, norm weights away from one), where bf16
    rounding moves log-probs by as much as it ever does."""
    model = tiny_model(hidden_size=64, intermediate_size=112, num_hidden_layers=3)
    model.reset_parameters(std=std, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model.eval()


@pytest.mark.parametrize("std", [0.02, 0.1])
def test_bf16_logprobs_stand_in_for_a_bf16_training_forward(std):
    """Under trainer.precision=bf16 on CPU the engine decodes by the autocast forward's recipe: the log-probs
    of its prefill (each response's first token) equal the training forward's (bitwise equal logits), and
    the decode steps' differ only where single-query attention's fp32 summation order flips a bf16 rounding: ten times closer
    than the same forward in fp32 is, and within 0.05 at most (PPO clips log-ratios at about 0.2)."""
    from scalerl.core.device import Autocast
    from scalerl.rollout.batch import RolloutBatch
    from scalerl.trainer.forward_passes import response_logprobs

    model = _sharp_model(std)
    engine = BuiltinEngine(model, PAD, dtype=torch.bfloat16)
    assert engine.logprobs_match_training_forward
    out = engine.generate(_prompts() * 4, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3))
    batch = RolloutBatch.from_generation(out, torch.arange(16), torch.zeros(16))
    mask = out.response_mask.bool()
    diffs = {}
    for precision, micro in (("bf16", 16), ("bf16", 3), ("fp32", 16)):
        ref = response_logprobs(model, batch, 1.0, micro, Autocast(precision, torch.device("cpu")))
        diffs[precision, micro] = (out.logprobs - ref).abs()
    bf16 = diffs["bf16", 16]
    assert torch.equal(bf16, diffs["bf16", 3])  # the training forward is batch-invariant
    # Prefill: bitwise equal logits (the two fp32 log-softmax formulas then differ by an ulp at most).
    assert bf16[:, 0].max() <= 1e-6
    # Measured here: max 4.8e-7 (logits bitwise equal throughout) against fp32's mean 5.6e-4 / 3.4e-3; on the
    # small model (h256, 4 layers) decode steps flip roundings: mean 3.5e-5 / 1.8e-3, max 1.9e-3 / 3.0e-2.
    assert bf16[mask].max() <= 0.05 and bf16[mask].mean() * 10 <= diffs["fp32", 16][mask].mean()


def test_which_engines_match_the_training_forward(model):
    assert BuiltinEngine(model, PAD).logprobs_match_training_forward  # fp32
    assert BuiltinEngine(model, PAD, dtype=torch.bfloat16).logprobs_match_training_forward  # CPU, fused, bf16
    # Continuous batching runs the model's own forward in its parameters' fp32: not the bf16 recipe.
    assert not BuiltinEngine(model, PAD, dtype=torch.bfloat16, max_num_seqs=2).logprobs_match_training_forward
    assert BuiltinEngine(model, PAD, max_num_seqs=2).logprobs_match_training_forward
    # Unfused, a bf16 request decodes in fp32: not what a bf16 training forward computes.
    assert not BuiltinEngine(model, PAD, dtype=torch.bfloat16, fused=False).logprobs_match_training_forward
    bf16_params = tiny_model(hidden_size=64, intermediate_size=112).to(torch.bfloat16)
    assert not BuiltinEngine(bf16_params, PAD).logprobs_match_training_forward  # bf16 norms and residual
