"""SFT: loss only on response tokens, learning on the built-in task, and an HF-loadable output."""

import json
from pathlib import Path

import torch

from scalerl.data.prompts import encode_demonstration
from scalerl.models.hf_checkpoint import from_pretrained
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.batch import RolloutBatch
from scalerl.trainer.sft_trainer import train_sft


def test_loss_covers_response_and_eos_only():
    tok = CharTokenizer()
    prompt, response = encode_demonstration(tok, {"prompt": "Q:1+2\nA:", "response": " #### 3", "ground_truth": "3"})
    assert prompt[0] == tok.bos_token_id and response[-1] == tok.eos_token_id
    assert tok.decode(prompt[1:]) == "Q:1+2\nA:" and tok.decode(response[:-1]) == " #### 3"
    batch = RolloutBatch.from_demonstrations([prompt, prompt[:3]], [response, response[:2]], tok.pad_token_id)
    width = len(prompt)
    assert batch.response_mask[0].tolist() == [1.0] * len(response)
    assert batch.response_mask[1].tolist() == [1.0, 1.0] + [0.0] * (len(response) - 2)
    # prompts left-padded, responses right-padded: [pad.. prompt | response ..pad]
    assert batch.attention_mask[1].tolist() == [0] * (width - 3) + [1] * 5 + [0] * (len(response) - 2)
    assert batch.input_ids[0, width:].tolist() == response


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


def test_sft_resume_is_bitwise_identical(tiny_config, tmp_path):
    from scalerl.trainer.sft_trainer import SFTTrainer

    def run(out, *extra):
        trainer = SFTTrainer.from_config(tiny_config(f"trainer.output_dir={tmp_path / out}", *extra))
        trainer.fit()
        return trainer

    straight = run("a", "sft.steps=4")
    run("b", "sft.steps=2", "trainer.save_every=2")
    resumed = SFTTrainer.from_config(tiny_config(f"trainer.output_dir={tmp_path / 'b'}", "sft.steps=4", "trainer.resume=auto"))
    assert resumed.step == 2
    resumed.fit()
    for (name, a), (_, b) in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    rows = [json.loads(x) for x in (tmp_path / "b" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]



def test_top_k_on_sft_from_scratch_is_warned_about():
    from scalerl.core.config import load_config
    from scalerl.trainer.sft_trainer import compression_warning

    topk = load_config(None, ["comm.gradient_compression=topk"])
    assert "powersgd" in compression_warning(topk, dp_size=2)
    assert compression_warning(topk, dp_size=1) is None  # nothing is compressed on one rank
    warm = load_config(None, ["comm.gradient_compression=topk", "trainer.init_from=some/model"])
    assert compression_warning(warm, dp_size=2) is None
    assert compression_warning(load_config(None, ["comm.gradient_compression=powersgd"]), dp_size=2) is None
