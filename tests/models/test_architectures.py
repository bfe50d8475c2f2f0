"""Every built-in architecture against transformers' own classes: logits both ways (their checkpoint in
scalerl, scalerl's in transformers), greedy generation through the KV cache with sliding windows shorter
than the sequence, parameter counts, and the errors bad checkpoints of the new kinds get."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scalerl.models.config import SUPPORTED_ARCHITECTURES
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import (
    CheckpointFormatError,
    from_pretrained,
    save_pretrained,
)
from scalerl.perf.flops import decoder_layer_tensor_count, decoder_param_count
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.models.hf_reference import (
    hf_logits,
    max_diff_on_real_tokens,
    randomize_norms_and_biases,
    token_batch,
)

VOCAB = 96
WINDOW = 5  # shorter than the 12-token batches and the generated sequences
# head_dim 24 != hidden 64 / 4 heads: the head size must come from the config, not from the division.
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=256)
GEMMA = dict(sliding_window=WINDOW, query_pre_attn_scalar=20, final_logit_softcapping=3.0)

# name -> (transformers config class, model class, the config's own fields)
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    # Qwen3 with its optional sliding window on the layers from max_window_layers on.
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM",
                      dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, attention_bias=True)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "mistral-no-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, num_key_value_heads=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(**GEMMA, attn_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(**GEMMA, sliding_window_pattern=2, rope_theta=50_000.0, rope_local_base_freq=3_000.0,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False)),
}


def hf_model(name: str):
    config_cls, model_cls, fields = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**SIZES, **fields})
    config._attn_implementation = "eager"  # Gemma 2's soft-capping has no SDPA path
    return randomize_norms_and_biases(getattr(transformers, model_cls)(config)).eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each architecture saved by transformers, in several safetensors shards."""
    dirs = {}
    for name in ARCHITECTURES:
        dirs[name] = tmp_path_factory.mktemp(name)
        hf_model(name).save_pretrained(dirs[name], max_shard_size="40KB")
    return dirs


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("padded", [False, True])
def test_transformers_checkpoint_gives_transformers_logits(hf_dirs, name, padded):
    assert len(list(hf_dirs[name].glob("model-*-of-*.safetensors"))) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    hf.config._attn_implementation = "eager"
    ours = from_pretrained(hf_dirs[name]).eval()
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ours.config.head_dim == 24
    ids, mask = token_batch(VOCAB, padded)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask if padded else None)
    assert max_diff_on_real_tokens(got, hf_logits(hf, ids, mask, padded), mask) <= 1e-4


def test_the_architecture_options_are_read(hf_dirs):
    """What the parity tests rely on is really in play (a window the batch exceeds, mixed layers, caps)."""
    qwen3 = from_pretrained(hf_dirs["qwen3-sliding"]).config
    assert qwen3.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2 and qwen3.sliding_window == WINDOW
    assert from_pretrained(hf_dirs["qwen3"]).config.sliding_window is None
    assert set(from_pretrained(hf_dirs["mistral"]).config.layer_types) == {"sliding_attention"}
    gemma2 = from_pretrained(hf_dirs["gemma2"]).config
    assert gemma2.layer_types[:2] == ["sliding_attention", "full_attention"] and gemma2.attn_logit_softcapping == 5.0
    gemma3 = from_pretrained(hf_dirs["gemma3"]).config
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling["factor"]) == (50_000.0, 3_000.0, 2.0)
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping == 3.0


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_our_checkpoint_gives_the_same_logits_in_transformers(hf_dirs, tmp_path, name):
    cfg = from_pretrained(hf_dirs[name]).config
    ours = randomize_norms_and_biases(build_model(cfg, seed=3)).eval()
    save_pretrained(ours, tmp_path, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == SUPPORTED_ARCHITECTURES[cfg.model_type]
    hf.config._attn_implementation = "eager"
    ids, mask = token_batch(VOCAB, padded=True)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
    assert max_diff_on_real_tokens(got, hf_logits(hf, ids, mask, padded=True), mask) <= 1e-4
    again = from_pretrained(tmp_path)
    assert again.config == ours.config
    for (key, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_generation_matches_transformers_generate(hf_dirs, name):
    """Prompts of 3-7 tokens plus 8 new ones: past the window of 5, so decode steps must drop old keys."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    hf.config._attn_implementation = "eager"
    ours = from_pretrained(hf_dirs[name]).eval()
    prompts = [[5, 17, 33, 8, 61, 2, 40], [7, 9, 11], [50, 51, 52, 53, 54]]
    out = BuiltinEngine(ours, pad_token_id=0).generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert out.response_ids[row].tolist() == ref[0, len(prompt):].tolist(), f"row {row}"


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_parameter_counts_follow_the_architecture(hf_dirs, name):
    model = from_pretrained(hf_dirs[name])
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name])
    assert decoder_param_count(model.config) == model.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert decoder_layer_tensor_count(model.config) == len(list(model.layers[0].parameters()))


def _rewrite_config(directory, **changes):
    raw = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (directory / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     r"model_type='gemma3'.*Gemma3ForCausalLM"),
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}, r"phi3.*Qwen3ForCausalLM"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, r"rope_scaling\.rope_type='yarn'"),
    ({"sliding_window": "5"}, "sliding_window='5'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"layer_types": 4}, "layer_types=4"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0"),
])
def test_bad_checkpoints_name_the_field(hf_dirs, tmp_path, changes, message):
    directory = tmp_path / "gemma"
    directory.mkdir()
    for file in hf_dirs["gemma2"].iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    _rewrite_config(directory, **changes)
    with pytest.raises(CheckpointFormatError, match=message):
        from_pretrained(directory)


def test_a_missing_gemma_norm_is_named(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    model = from_pretrained(hf_dirs["gemma3"])
    save_pretrained(model, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_pipeline_stages_compute_the_same_logits(hf_dirs, name):
    """Two stages cut from the model (embedding scale, per-layer RoPE and windows, capped head) chain to
    the whole model's logits."""
    from scalerl.parallel.pipeline import DecoderStage

    model = from_pretrained(hf_dirs[name]).eval()
    first = DecoderStage(model, [0, 1], first=True, last=False)
    last = DecoderStage(model, [2, 3], first=False, last=True)
    ids, mask = token_batch(VOCAB, padded=True)
    with torch.no_grad():
        staged = last(*first(ids, mask))
        whole = model(ids, attention_mask=mask)
    assert max_diff_on_real_tokens(staged, whole, mask) <= 1e-5


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("padded", [False, True])
def test_chunks_through_the_kv_cache_give_the_full_forward(hf_dirs, name, padded):
    """Prefill 6 tokens, a chunk of 3, then single steps: each chunk's queries see the window of cached keys
    (sliced to what they can reach) exactly as one forward over the 12 tokens does."""
    from scalerl.models.kv_cache import KVCache

    model = from_pretrained(hf_dirs[name]).eval()
    ids, mask = token_batch(VOCAB, padded)
    cache = KVCache.for_model(model, ids.shape[0], ids.shape[1])
    pieces, start = [], 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask if padded else None)
        for end in (6, 9, 10, 11, 12):
            pieces.append(model(ids[:, start:end], attention_mask=mask[:, :end] if padded else None,
                                kv_cache=cache, cache_start=start))
            start = end
    assert max_diff_on_real_tokens(torch.cat(pieces, dim=1), full, mask) <= 1e-5


def test_gemma_embedding_scale_is_rounded_to_the_model_dtype():
    """sqrt(3072) = 55.43 is 55.5 in bf16; transformers multiplies by the rounded value, so must we."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    from scalerl.models.decoder import ScaledEmbedding

    ours = ScaledEmbedding(4, 3072).to(torch.bfloat16)
    ref = Gemma2TextScaledWordEmbedding(4, 3072, padding_idx=0, embed_scale=3072**0.5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
    ids = torch.tensor([[0, 1, 2, 3]])
    assert torch.equal(ours(ids), ref(ids))
    assert not torch.equal(ours(ids), (ours.weight[ids].float() * 3072**0.5).to(torch.bfloat16))


RUN_ARCHITECTURES = {
    "qwen3": {"attention_bias": False},
    "gemma2": {"attention_bias": False, "hidden_act": "gelu_pytorch_tanh", "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"attention_bias": False, "hidden_act": "gelu_pytorch_tanh", "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
                    "rope_local_theta": 1000.0},
}


@pytest.mark.parametrize("model_type", list(RUN_ARCHITECTURES))
def test_a_run_trains_and_exports_each_architecture(tmp_path, model_type):
    from scalerl.cli import main
    from scalerl.core.config import BUILTIN_MAX_POSITIONS, BUILTIN_VOCAB_SIZE
    from scalerl.models.config import ModelConfig
    from scalerl.models.tokenizer import CharTokenizer
    from tests.tiny import TINY

    tok = CharTokenizer()
    cfg = ModelConfig(model_type=model_type, vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=BUILTIN_MAX_POSITIONS, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **RUN_ARCHITECTURES[model_type])
    save_pretrained(build_model(cfg, seed=1), tmp_path / "source", tokenizer=tok)
    assert main(["train", f"model.path={tmp_path / 'source'}", *TINY, f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    assert from_pretrained(tmp_path / "run" / "final").config == from_pretrained(tmp_path / "source").config


# Published config.json files (as on the Hugging Face Hub, transformers 4.x style), written out here.
PUBLISHED_CONFIGS = {
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    },
    "gemma-3-1b-pt": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144, "eos_token_id": [1, 106],
    },
}


@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_published_configs_build_the_shapes_transformers_builds(name):
    """At real size, on the meta device (no memory): every tensor's name and shape equal transformers'."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from scalerl.models.decoder import CausalLM
    from scalerl.models.hf_checkpoint import model_config_from_hf

    raw = PUBLISHED_CONFIGS[name]
    cfg = model_config_from_hf(raw, name)
    hf_config = CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    assert cfg.layer_types == list(getattr(hf_config, "layer_types", None) or cfg.layer_types)
    with torch.device("meta"):
        ours = CausalLM(cfg)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    ours_shapes = {("" if n.startswith("lm_head") else "model.") + n: tuple(p.shape) for n, p in ours.named_parameters()}
    hf_shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert ours_shapes == hf_shapes
    assert decoder_param_count(cfg) == sum(p.numel() for p in hf.parameters())
    if name == "gemma-3-1b-pt":  # five sliding layers, then a global one
        assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23]


@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_absent_fields_take_the_defaults_transformers_takes(name):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from scalerl.models.hf_checkpoint import model_config_from_hf

    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    raw = {k: v for k, v in PUBLISHED_CONFIGS[name].items() if k in keep}
    cfg = model_config_from_hf(raw, name)
    hf = CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (cfg.head_dim, cfg.tie_word_embeddings, cfg.sliding_window) == (
        hf_head_dim, hf.tie_word_embeddings, hf.sliding_window)
    assert cfg.layer_types == list(getattr(hf, "layer_types", None) or cfg.layer_types)
    rope = hf.rope_parameters
    if "full_attention" in rope:
        assert (cfg.rope_theta, cfg.rope_local_theta) == (rope["full_attention"]["rope_theta"],
                                                          rope["sliding_attention"]["rope_theta"])
    else:
        assert cfg.rope_theta == rope["rope_theta"]
    assert cfg.max_position_embeddings == hf.max_position_embeddings
