"""Exports like the source: sharded safetensors with an index past the shard size, in the source's dtype
unless told otherwise, loadable by transformers with the same logits; the trained model is never cast.
(Laid-out models at world 2: tests/models/test_sharded_loading.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from scalerl.checkpoint.export import export_hf_model
from scalerl.checkpoint.streamed_export import export_dtype, plan_shards
from scalerl.core.config import byte_size
from scalerl.models.hf_checkpoint import from_pretrained, save_pretrained
from scalerl.models.tokenizer import CharTokenizer
from scalerl.trainer.sft_trainer import train_sft
from tests.tiny import tiny_model, tiny_run_model

transformers = pytest.importorskip("transformers")


def test_plan_shards_cuts_at_the_limit():
    assert plan_shards({"a": 4, "b": 4, "c": 4}, 8) == [["a", "b"], ["c"]]
    assert plan_shards({"big": 20, "a": 1}, 8) == [["a"], ["big"]]  # too big for any shard: one of its own
    assert plan_shards({"a": 4}, 100) == [["a"]]


def test_byte_sizes():
    assert byte_size("5GB") == 5 * 10**9 and byte_size("2GiB") == 2 * 2**30 and byte_size("6000B") == 6000
    with pytest.raises(ValueError, match="not a size"):
        byte_size("5 bananas")


def _transformers_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_bf16_sharded_source_exports_as_bf16_shards(tmp_path):
    source = save_pretrained(tiny_model(seed=5, vocab_size=67).to(torch.bfloat16), tmp_path / "src",
                             max_shard_bytes=6000)
    model = from_pretrained(source)  # trains in float32
    dtype = export_dtype("source", str(source), "float32")
    assert dtype == torch.bfloat16
    out = export_hf_model(model, CharTokenizer(), tmp_path / "out", dtype=dtype, max_shard_bytes=6000)
    assert next(model.parameters()).dtype == torch.float32  # the export cast copies, never the model
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source_index = json.loads((source / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == source_index["weight_map"] and len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for file in set(index["weight_map"].values()):
        ours, theirs = load_file(out / file), load_file(source / file)
        assert all(ours[n].dtype == torch.bfloat16 and torch.equal(ours[n], theirs[n]) for n in theirs)
    ids = torch.randint(0, 67, (2, 9))
    with torch.no_grad():
        ours = from_pretrained(out).eval()(ids)
    assert torch.allclose(_transformers_logits(out, ids), ours, atol=1e-4)


def test_export_dtype_told_otherwise_and_builtin(tmp_path):
    source = save_pretrained(tiny_model(seed=5), tmp_path / "src")  # float32, one file
    assert export_dtype("source", str(source), "bfloat16") == torch.float32
    assert export_dtype("float16", str(source), "float32") == torch.float16
    assert export_dtype("source", None, "bfloat16") == torch.bfloat16  # the built-in model: model.dtype
    out = export_hf_model(from_pretrained(source), None, tmp_path / "out", dtype=torch.float16)
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == torch.float16
    assert not (out / "model.safetensors.index.json").exists()


def test_a_run_exports_like_its_source(tiny_config, tmp_path):
    """SFT from a bf16 model directory trains in float32 and exports bf16 shards (trainer options)."""
    source = save_pretrained(tiny_run_model(CharTokenizer(), seed=1).to(torch.bfloat16), tmp_path / "src")
    train_sft(tiny_config(f"model.path={source}", "model.tokenizer=builtin", "sft.steps=1",
                          "trainer.export_max_shard_size=20000B"))
    out = tmp_path / "run" / "sft" / "model"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(t.dtype == torch.bfloat16 for f in files for t in load_file(out / f).values())
    ids = torch.randint(0, 60, (1, 8))
    with torch.no_grad():
        ours = from_pretrained(out).eval()(ids)
    assert torch.allclose(_transformers_logits(out, ids), ours, atol=1e-4)
