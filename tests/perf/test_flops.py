"""FLOPs model: parameter counts against Hugging Face models, the formula by hand, peak and MFU."""

import math

import pytest
import torch

from scalerl.models.config import ModelConfig
from scalerl.perf import flops
from scalerl.perf.flops import (
    decoder_param_count,
    device_peak_flops,
    flops_per_token,
    forward_flops_per_token,
    matmul_param_count,
)
from tests.tiny import tiny_model_config

MLP_WIDTH = {"intermediate_size": 48}  # the tiny model, with this file's own MLP width


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.model_type == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=cfg.attention_bias, **common))


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_model_config(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True, **MLP_WIDTH),
        tiny_model_config(model_type="qwen2", num_key_value_heads=1, tie_word_embeddings=False, head_dim=16,
                          **MLP_WIDTH),
        tiny_model_config(model_type="llama", num_key_value_heads=2, attention_bias=False, tie_word_embeddings=False,
                          **MLP_WIDTH),
        tiny_model_config(model_type="llama", num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True,
                          **MLP_WIDTH),
    ],
    ids=["qwen2-tied-gqa", "qwen2-untied-mqa-headdim", "llama-untied", "llama-tied-bias"],
)
def test_param_counts_match_hugging_face_model(cfg):
    model = hf_model(cfg)
    assert decoder_param_count(cfg) == sum(p.numel() for p in model.parameters())
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_param_count(cfg) == linear_weights


def test_flops_formula_by_hand():
    cfg = ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288; mlp 3*64*176 = 33792; lm_head 64*256 = 16384
    n_matmul = 2 * (12288 + 33792) + 16384
    assert matmul_param_count(cfg) == n_matmul == 108544
    # attention: 12 * layers * (heads * head_dim) * seq_len, no causal halving
    assert flops_per_token(cfg, 128) == 6 * 108544 + 12 * 2 * 64 * 128 == 847872
    assert forward_flops_per_token(cfg, 128) == 2 * 108544 + 4 * 2 * 64 * 128 == 282624


def test_cpu_peak_is_measured_once_and_cached(monkeypatch):
    monkeypatch.setattr(flops, "_MEASURED_PEAK_CACHE", {})
    calls = []
    real_measure = flops.measure_matmul_flops

    def counting_measure(*args, **kwargs):
        calls.append(args)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(flops, "measure_matmul_flops", counting_measure)
    first = device_peak_flops("cpu")
    assert math.isfinite(first) and first > 0
    assert device_peak_flops(torch.device("cpu"), torch.float32) == first
    assert len(calls) == 1


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H200", torch.float16, 989.4e12),
        ("NVIDIA L40S", torch.bfloat16, 362.05e12),
        ("NVIDIA A10G", torch.bfloat16, 125e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_gpu_table_matches_device_names(name, dtype, expected):
    assert flops._table_peak_flops(name, dtype, tf32_allowed=False) == expected


def test_gpu_table_fp32_uses_tf32_peak_when_allowed():
    assert flops._table_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32_allowed=True) == 156e12
