"""`scalerl export CHECKPOINT HF_DIR`: single-process RL (with a critic) and SFT checkpoints to Hugging Face
directories that transformers loads offline, with the checkpoint's exact weights. (Distributed checkpoints:
tests/checkpoint/test_reshard.py and test_distributed_resume.py export theirs.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from scalerl.cli import main
from scalerl.trainer.rl_trainer import train
from scalerl.trainer.sft_trainer import train_sft
from tests.checkpoint.hf_compare import assert_loads_in_transformers

pytest.importorskip("transformers")


def test_export_rl_checkpoint_with_a_critic(tiny_config, length_reward, tmp_path, capsys):
    cfg = tiny_config("trainer.total_steps=2", "trainer.save_every=1", "algorithm.adv_estimator=gae", length_reward)
    summary = train(cfg)
    run = tmp_path / "run"
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0  # a run directory: its latest checkpoint
    assert "step_00000002" in capsys.readouterr().out
    assert_loads_in_transformers(tmp_path / "hf", run / "final")
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["model_config"]["hidden_size"] == 32 and summary["final_model"].endswith("final")

    # An older checkpoint by path; a non-empty HF_DIR is refused without --overwrite, replaced with it.
    assert main(["export", str(run / "checkpoints" / "step_00000001"), str(tmp_path / "hf")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(run / "checkpoints" / "step_00000001"), str(tmp_path / "hf"), "--overwrite"]) == 0
    older = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert not torch.equal(older["model.norm.weight"], load_file(str(run / "final" / "model.safetensors"))["model.norm.weight"])


def test_export_sft_checkpoint(tiny_config, tmp_path):
    cfg = tiny_config("trainer.save_every=0")
    train_sft(cfg)
    sft = tmp_path / "run" / "sft"
    assert main(["export", str(sft / "checkpoints"), str(tmp_path / "hf")]) == 0
    assert_loads_in_transformers(tmp_path / "hf", sft / "model")


def test_export_errors_name_the_problem(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 2
    assert "holds no complete one" in capsys.readouterr().err
