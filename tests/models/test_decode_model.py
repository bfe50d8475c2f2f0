"""The fused decode forward: in fp32 the same tokens and log-probs as the model's own forward for every fused
architecture, the model's own forward for the others, relaid out after every weight write, and in bf16 the
numerics of a bf16-autocast forward."""

import os

import pytest
import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decode_model import DecodeModel, fused_decode_unsupported
from scalerl.models.decoder import build_model
from scalerl.models.lora import apply_lora
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams

PAD = 0
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24)
FUSED = {
    "qwen2": {},
    "llama": dict(model_type="llama", attention_bias=False, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", attention_bias=False),
    "mistral-sliding": dict(model_type="mistral", attention_bias=False, sliding_window=5,
                            layer_types=["sliding_attention"] * 3),
    "qwen3-some-sliding": dict(model_type="qwen3", sliding_window=5,
                               layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}
UNFUSED = {
    "gemma2": dict(model_type="gemma2", sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"] * 1
                   + ["sliding_attention"]),
    "gemma3": dict(model_type="gemma3_text", sliding_window=5, rope_local_theta=3000.0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}
SAMPLINGS = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
             SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20, seed=2),
             SamplingParams(max_new_tokens=12, temperature=0.0)]


def _model(changes):
    model = build_model(ModelConfig(**{**BASE, **changes}), seed=0).eval()
    with torch.no_grad():  # norms away from one, biases away from zero: a missed one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0.5, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 2, 7)]


def _assert_same_generation(model, sampling, **engine_kwargs):
    fused = BuiltinEngine(model, PAD, **engine_kwargs)
    assert fused.fused
    ours = fused.generate(_prompts(), sampling)
    ref = BuiltinEngine(model, PAD, fused=False).generate(_prompts(), sampling)
    assert torch.equal(ours.response_ids, ref.response_ids)
    assert (ours.logprobs - ref.logprobs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_fp32_fused_decoding_gives_the_model_forward_tokens_and_logprobs(name, sampling):
    _assert_same_generation(_model(FUSED[name]), sampling)


def test_lora_adapters_are_merged_into_the_packed_weights():
    model = _model({})
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj", "up_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    _assert_same_generation(model, SAMPLINGS[0])


@pytest.mark.parametrize("name", list(UNFUSED))
def test_unfused_architectures_decode_with_the_model_forward(name):
    model = _model(UNFUSED[name])
    assert fused_decode_unsupported(model) is not None
    with pytest.raises(ValueError, match="no fused decode path"):
        DecodeModel(model)
    engine = BuiltinEngine(model, PAD, dtype=torch.bfloat16)
    assert not engine.fused and engine.compute_dtype == torch.float32 and engine.refresh_weights() == 0
    out = engine.generate(_prompts(), SAMPLINGS[2])
    ref = BuiltinEngine(model, PAD, fused=False).generate(_prompts(), SAMPLINGS[2])
    assert torch.equal(out.response_ids, ref.response_ids) and torch.equal(out.logprobs, ref.logprobs)


def test_an_optimizer_step_is_seen_by_the_next_generation():
    model = _model({})
    engine = BuiltinEngine(model, PAD)
    before = engine.generate(_prompts(), SAMPLINGS[2])
    assert not engine.decode_model.is_stale()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.tensor([[5, 6, 7, 8]])).logsumexp(-1).sum().backward()
    optimizer.step()
    assert engine.decode_model.is_stale()
    after = engine.generate(_prompts(), SAMPLINGS[2])
    ref = BuiltinEngine(model, PAD, fused=False).generate(_prompts(), SAMPLINGS[2])
    assert torch.equal(after.response_ids, ref.response_ids) and not torch.equal(after.logprobs, before.logprobs)


def test_bf16_decoding_computes_what_a_bf16_autocast_forward_does(cpu_isa):
    model = _model({})
    engine = BuiltinEngine(model, PAD, dtype=torch.bfloat16)
    out = engine.generate(_prompts(), SAMPLINGS[0])
    assert engine.decode_model.layers[0].qkv.weight.dtype == torch.bfloat16
    assert engine.decode_model.weight_bytes * 2 == DecodeModel(model).weight_bytes
    assert engine.logprobs_match_training_forward and BuiltinEngine(model, PAD).logprobs_match_training_forward
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1).bool()
    p = out.prompt_ids.shape[1]
    per_precision = {}
    for autocast in (True, False):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids, attention_mask=mask.long()).float()[:, p - 1: -1]
        ref = logits.log_softmax(-1).gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)
        per_precision[autocast] = (out.logprobs - ref)[out.response_mask.bool()].abs()
    # bf16 rounding separates them, not a different computation: close to autocast, closer than to fp32.
    assert per_precision[True].max() < 0.05 and per_precision[True].mean() < per_precision[False].mean()


def test_small_fp32_matrices_stay_plain_and_the_rest_take_the_blocked_layout_where_the_cpu_runs_it(cpu_isa):
    from scalerl.models.decode_model import FP32_PLAIN_MAX

    model = build_model(ModelConfig(**{**BASE, "hidden_size": 128, "intermediate_size": 1100, "head_dim": 32}),
                        seed=0).eval()
    fp32, bf16 = DecodeModel(model).layers[0], DecodeModel(model, torch.bfloat16).layers[0]
    assert fp32.o.weight.numel() <= FP32_PLAIN_MAX and not fp32.o.onednn and not fp32.o.weight.is_mkldnn
    assert fp32.gate_up.weight.numel() > FP32_PLAIN_MAX
    assert fp32.gate_up.onednn == fp32.gate_up.weight.is_mkldnn == cpu_isa.onednn_blocked(torch.float32)
    assert bf16.o.onednn == bf16.gate_up.onednn == bf16.gate_up.weight.is_mkldnn == cpu_isa.onednn_blocked(torch.bfloat16)
    if cpu_isa.level == "default":  # the fallback: plain tensors whatever the CPU has
        assert not any(m.onednn for m in (fp32.gate_up, bf16.o, bf16.gate_up, bf16.down))
    _assert_same_generation(model, SAMPLINGS[2])  # plain and blocked matrices in one step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_blocked_layout_computes_what_the_plain_fallback_does(dtype, monkeypatch):
    """Where the CPU has the fast path, its products and generation match the fallback's (forced by the switch)."""
    from tests.conftest import needs_onednn_blocked

    needs_onednn_blocked(dtype)
    model = build_model(ModelConfig(**{**BASE, "hidden_size": 128, "intermediate_size": 1100, "head_dim": 32}),
                        seed=0).eval()
    fast = DecodeModel(model, dtype)
    monkeypatch.setenv("SCALERL_CPU_ISA", "default")
    plain = DecodeModel(model, dtype)
    assert fast.layers[0].gate_up.onednn and not plain.layers[0].gate_up.onednn
    generator = torch.Generator().manual_seed(0)
    for name in ("gate_up", "down"):
        blocked, flat = getattr(fast.layers[0], name), getattr(plain.layers[0], name)
        x = torch.randn(16, flat.weight.shape[1], generator=generator).to(dtype)
        torch.testing.assert_close(blocked(x).float(), flat(x).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-4)
    sampling = SAMPLINGS[2]
    outs = []
    for level in ("native", "default"):
        monkeypatch.setenv("SCALERL_CPU_ISA", level)
        outs.append(BuiltinEngine(model, PAD, dtype=dtype).generate(_prompts(), sampling))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert (outs[0].logprobs - outs[1].logprobs).abs().max().item() <= (0.05 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SCALERL_COMPILE_TESTS"),
                    reason="compiles with inductor: 629 s on the shared 2-core machine; SCALERL_COMPILE_TESTS=1 runs it")
def test_compiled_decode_path_gives_the_eager_tokens():
    """``compile=True`` (plain weights through torch.compile; off by default, slower here): same greedy tokens."""
    model = _model({})
    engine = BuiltinEngine(model, PAD)
    engine.decode_model = DecodeModel(model, compile=True)
    assert engine.decode_model.compiled and not engine.decode_model.layers[0].gate_up.onednn
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    out = engine.generate(_prompts(), sampling)
    ref = BuiltinEngine(model, PAD).generate(_prompts(), sampling)
    assert torch.equal(out.response_ids, ref.response_ids)
    assert (out.logprobs - ref.logprobs).abs().max().item() <= 1e-5
