"""Shared check for exported models: exact weights, and transformers agrees with scalerl on the logits."""

import os

import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def assert_loads_in_transformers(hf_dir, reference_dir):
    """``hf_dir`` holds ``reference_dir``'s weights exactly, and transformers' logits match scalerl's."""
    import transformers

    from scalerl.models.hf_checkpoint import from_pretrained

    exported, reference = load_file(str(hf_dir / "model.safetensors")), load_file(str(reference_dir / "model.safetensors"))
    assert sorted(exported) == sorted(reference)
    for name in reference:
        assert torch.equal(exported[name], reference[name]), name
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    ours = from_pretrained(hf_dir).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.allclose(hf_model(ids).logits, ours(ids), atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    assert tokenizer("Q:1+2").input_ids
