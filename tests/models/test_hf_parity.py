"""Logit parity with Hugging Face transformers, both directions of checkpoint interop, and load errors."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import (
    CheckpointFormatError,
    from_pretrained,
    save_pretrained,
)
from tests.models.hf_reference import randomize_norms_and_biases, token_batch

VOCAB = 96


def _hf_model(arch: str, kv_heads: int, tied: bool, rope_scaling=None):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, tie_word_embeddings=tied, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    return randomize_norms_and_biases(model).eval()


def _batch(padded: bool):
    return token_batch(VOCAB, padded)


LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = [
    ("qwen2", 4, False, None),  # GQA ratio 1 (MHA), untied
    ("qwen2", 2, True, None),  # GQA ratio 2, tied
    ("llama", 1, False, None),  # GQA ratio 4 (MQA)
    ("llama", 2, True, LLAMA3_SCALING),
]


@pytest.mark.parametrize("arch,kv_heads,tied,scaling", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_logits_match_transformers(tmp_path, arch, kv_heads, tied, scaling, padded):
    hf = _hf_model(arch, kv_heads, tied, scaling)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    assert ours.config.tie_word_embeddings == tied
    ids, mask = _batch(padded)
    with torch.no_grad():
        if padded:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        else:
            ref = hf(input_ids=ids).logits
        got = ours(ids, attention_mask=mask if padded else None)
    valid = mask.bool()
    assert (got[valid] - ref[valid]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch,kv_heads,tied,scaling", CASES[:3])
def test_our_checkpoint_loads_in_transformers(tmp_path, arch, kv_heads, tied, scaling):
    cfg = ModelConfig(
        model_type=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
        attention_bias=arch == "qwen2", rope_theta=10000.0,
    )
    ours = build_model(cfg, seed=3).eval()
    save_pretrained(ours, tmp_path, generation_config={"do_sample": True})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = _batch(padded=True)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask)
    assert (got[mask.bool()] - ref[mask.bool()]).abs().max().item() <= 1e-4
    assert json.loads((tmp_path / "generation_config.json").read_text())["do_sample"] is True


def test_sharded_save_round_trip(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, tie_word_embeddings=False)
    model = build_model(cfg, seed=5)
    save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    again = from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert sum(p.numel() for p in hf.parameters()) == model.num_parameters()


def test_load_errors_name_the_problem(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112)
    save_pretrained(build_model(cfg), tmp_path / "m")
    with pytest.raises(CheckpointFormatError, match="config.json"):
        from_pretrained(tmp_path / "missing")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, "intermediate_size": 100}))
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"):
        from_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({**raw, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(CheckpointFormatError, match="gpt2"):
        from_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):
        from_pretrained(tmp_path / "m")
