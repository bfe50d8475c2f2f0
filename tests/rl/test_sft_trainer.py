"""SFT: loss only on response tokens, learning on the built-in task, and an HF-loadable output."""

import json
from pathlib import Path

import torch

from scalerl.models.hf_checkpoint import from_pretrained
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rl.sft_trainer import collate, sft_example, train_sft


def test_loss_mask_covers_response_and_eos_only():
    tok = CharTokenizer()
    ids, prompt_len = sft_example(tok, {"prompt": "Q:1+2\nA:", "response": " #### 3", "ground_truth": "3"})
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[1:prompt_len]) == "Q:1+2\nA:"
    batch = collate([(ids, prompt_len), (ids[:5], 3)], tok.pad_token_id)
    assert batch["loss_mask"][0].tolist() == [0.0] * prompt_len + [1.0] * (len(ids) - prompt_len)
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * (len(ids) - 5)
    assert batch["loss_mask"][1, 5:].sum() == 0


def test_sft_learns_and_saves_a_loadable_model(tiny_config):
    cfg = tiny_config("sft.steps=30", "sft.lr=3e-3", "sft.warmup_steps=2")
    summary = train_sft(cfg)
    lines = [json.loads(x) for x in (Path(cfg.trainer.output_dir) / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["sft/loss"] < 0.6 * lines[0]["sft/loss"]
    assert "val/accuracy" in lines[-1]
    model = from_pretrained(summary["model_dir"])
    assert (Path(summary["model_dir"]) / "tokenizer.json").is_file()
    assert model.config.hidden_size == 32
    ids = torch.tensor([[1, 52, 30]])
    assert torch.isfinite(model(ids)).all()
