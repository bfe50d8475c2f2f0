"""`save_pretrained` replaces a model directory as a whole: no stale file of another sharding survives (a stale
index would break scalerl's loader, a stale model.safetensors would make transformers load old weights), an
interrupted save leaves the old directory intact, and leftovers of a killed save are put right."""

import os
import stat

import pytest
import torch

from scalerl.core.file_modes import dir_mode, file_mode
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import (
    from_pretrained,
    remove_interrupted_saves,
    save_pretrained,
)
from scalerl.models.tokenizer import CharTokenizer

transformers = pytest.importorskip("transformers")
CFG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 112, "tie_word_embeddings": False}
SHARD_BYTES = 40_000  # splits this model into several shards


def assert_same_weights(model, directory):
    again = from_pretrained(directory)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    assert torch.equal(hf.model.norm.weight, model.norm.weight.detach())


@pytest.mark.parametrize("first, second", [(SHARD_BYTES, 4 * 1024**3), (4 * 1024**3, SHARD_BYTES)])
def test_a_save_with_another_sharding_leaves_no_stale_file(tmp_path, first, second):
    old, new = build_model(ModelConfig(**CFG), seed=1), build_model(ModelConfig(**CFG), seed=2)
    with torch.no_grad():
        new.norm.weight.add_(1.0)  # tells the two apart in transformers too
    save_pretrained(old, tmp_path / "m", max_shard_bytes=first)
    save_pretrained(new, tmp_path / "m", max_shard_bytes=second, tokenizer=CharTokenizer())
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    sharded = second == SHARD_BYTES
    assert ("model.safetensors.index.json" in names) == sharded and ("model.safetensors" in names) != sharded
    assert "tokenizer.json" in names
    assert_same_weights(new, tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging or old copy left beside it


def test_an_interrupted_save_leaves_the_old_directory_intact(tmp_path):
    old = build_model(ModelConfig(**CFG), seed=1)
    save_pretrained(old, tmp_path / "m")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}

    class FailingTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_pretrained(build_model(ModelConfig(**CFG), seed=2), tmp_path / "m", tokenizer=FailingTokenizer())
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_leftovers_of_a_killed_save_are_put_right(tmp_path):
    model = build_model(ModelConfig(**CFG), seed=1)
    save_pretrained(model, tmp_path / "m")
    # Killed between "move the old copy aside" and "move the new one in": the old copy comes back.
    os.rename(tmp_path / "m", tmp_path / f".old-m-{4242}")
    save_pretrained(model, tmp_path / ".tmp-m-4243")  # a complete-looking staging copy is still a leftover
    (tmp_path / ".m.tmp-99").mkdir()  # an earlier scalerl version's staging name
    done = remove_interrupted_saves(tmp_path / "m")
    assert "restored m from .old-m-4242" in done and len(done) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert_same_weights(model, tmp_path / "m")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_files_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        save_pretrained(build_model(ModelConfig(**CFG), seed=1), tmp_path / "m", tokenizer=CharTokenizer())
        assert (file_mode(), dir_mode()) == (0o666 & ~umask, 0o777 & ~umask)
    finally:
        os.umask(previous)
    for path in [tmp_path / "m", *(tmp_path / "m").iterdir()]:
        expected = 0o777 & ~umask if path.is_dir() else 0o666 & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path  # safetensors alone would write 0600
