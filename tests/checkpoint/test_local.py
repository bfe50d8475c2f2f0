"""Atomic checkpoints: bitwise-exact resume, pruning, crash safety and clear load errors."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from scalerl.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from scalerl.checkpoint import local as checkpoint

VOCAB, HIDDEN = 16, 8


class TinyTiedLM(torch.nn.Module):
    """Embedding and output head share one weight, as in tied-embedding decoders."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.dropout = torch.nn.Dropout(0.1)  # draws from the global torch RNG every step
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(torch.tanh(self.mix(self.embed(tokens)))))


def make_run(seed: int, vocab: int = VOCAB):
    torch.manual_seed(seed)
    model = TinyTiedLM(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    sampler = torch.Generator().manual_seed(seed + 1)
    return model, optimizer, scheduler, sampler


def train(model, optimizer, scheduler, sampler, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=sampler)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach().clone())
    return losses


def random_draws(sampler: torch.Generator) -> tuple:
    return torch.rand(3), random.random(), np.random.rand(), torch.rand(3, generator=sampler)


def save_run(root, step, run, **extra):
    model, optimizer, scheduler, sampler = run
    return save_checkpoint(
        root, step, model=model, optimizer=optimizer, scheduler=scheduler, generators={"sampler": sampler}, **extra
    )


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    random.seed(0)
    np.random.seed(0)
    run = make_run(seed=0)
    train(*run, steps=3)
    path = save_run(tmp_path, 3, run, trainer_state={"data_position": 12})
    reference_losses = train(*run, steps=3)
    reference_draws = random_draws(run[3])
    reference_params = {name: p.detach().clone() for name, p in run[0].named_parameters()}

    resumed = make_run(seed=123)  # different weights and RNG streams until the load
    random.seed(99)
    np.random.seed(99)
    loaded = load_checkpoint(
        path, model=resumed[0], optimizer=resumed[1], scheduler=resumed[2], generators={"sampler": resumed[3]}
    )
    assert loaded.step == 3 and loaded.trainer_state == {"data_position": 12, "step": 3}
    assert resumed[0].head.weight is resumed[0].embed.weight  # the tie survives loading
    losses = train(*resumed, steps=3)
    draws = random_draws(resumed[3])

    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))
    for name, param in resumed[0].named_parameters():
        assert torch.equal(param, reference_params[name]), name
    assert torch.equal(draws[0], reference_draws[0]) and torch.equal(draws[3], reference_draws[3])
    assert draws[1:3] == reference_draws[1:3]
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        assert len([k for k in handle.keys() if k in ("embed.weight", "head.weight")]) == 1  # stored once


def test_keep_last_prunes_oldest_but_never_the_one_just_written(tmp_path):
    run = make_run(seed=0)
    for step in range(1, 6):
        save_run(tmp_path, step, run, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    save_run(tmp_path, 2, run, keep_last=2)  # rewriting an older step keeps it, and the newest other
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000005"]
    assert not list(tmp_path.glob(".*"))  # no temporary or half-deleted directories left behind


def test_saving_the_same_step_again_replaces_it(tmp_path):
    run = make_run(seed=0)
    save_run(tmp_path, 7, run, trainer_state={"data_position": 1})
    save_run(tmp_path, 7, run, trainer_state={"data_position": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000007"]
    assert load_checkpoint(tmp_path / "step_00000007", model=make_run(1)[0]).trainer_state["data_position"] == 2


def test_crash_mid_save_leaves_the_previous_checkpoint_as_latest(tmp_path, monkeypatch):
    run = make_run(seed=0)
    first = save_run(tmp_path, 1, run)
    real_save = checkpoint.save_torch_state

    def crash_on_scheduler(obj, file):
        if file.name == "scheduler.pt":
            raise RuntimeError("simulated crash")
        real_save(obj, file)

    monkeypatch.setattr(checkpoint, "save_torch_state", crash_on_scheduler)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_run(tmp_path, 2, run)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    load_checkpoint(first, model=make_run(1)[0])

    # A hard kill skips the cleanup: a complete-looking temp dir is ignored, then removed by the next save.
    shutil.copytree(first, tmp_path / ".tmp-step_00000009-424242")
    assert latest_checkpoint(tmp_path) == first
    save_run(tmp_path, 2, run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_kill_between_the_two_renames_of_a_replace_is_recovered(tmp_path):
    run = make_run(seed=0)
    first = save_run(tmp_path, 1, run)
    first.rename(tmp_path / ".old-step_00000001-424242")  # old copy moved aside, new one never arrived
    save_run(tmp_path, 2, run)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]


def test_corrupt_or_missing_file_is_named(tmp_path):
    run = make_run(seed=0)
    path = save_run(tmp_path, 1, run)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        load_checkpoint(path, model=make_run(1)[0])
    assert weights.read_bytes() == bytes(data)  # loading never repairs or rewrites

    path = save_run(tmp_path, 2, run)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="missing optimizer.pt"):
        load_checkpoint(path, model=make_run(1)[0])


def test_shape_mismatch_names_the_tensor_and_changes_nothing(tmp_path):
    path = save_run(tmp_path, 1, make_run(seed=0))
    model = TinyTiedLM(vocab=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'embed.weight' has shape \(16, 8\) in the checkpoint but \(32, 8\)"):
        load_checkpoint(path, model=model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_optimizer_with_other_parameters_is_rejected(tmp_path):
    path = save_run(tmp_path, 1, make_run(seed=0))
    model = TinyTiedLM()
    optimizer = torch.optim.AdamW(model.mix.parameters())
    with pytest.raises(CheckpointError, match="group 0 has 3 parameter.* but 2 in the optimizer"):
        load_checkpoint(path, model=model, optimizer=optimizer)


def test_config_mismatch_names_key_and_both_values(tmp_path):
    config = {"model": {"hidden_size": 8}, "lr": 0.01, "seed": 1}
    path = save_run(tmp_path, 1, make_run(seed=0), config=config)
    changed = {"model": {"hidden_size": 16}, "lr": 0.02, "seed": 1}
    with pytest.raises(CheckpointError, match="'model.hidden_size': saved 8, current 16"):
        load_checkpoint(path, model=make_run(1)[0], expected_config=changed, strict_config_keys=["model.hidden_size"])
    with pytest.raises(CheckpointError, match="'lr': saved 0.01, current 0.02"):
        load_checkpoint(path, model=make_run(1)[0], expected_config=changed)
    only_lr_changed = {"model": {"hidden_size": 8}, "lr": 0.02, "seed": 1}
    load_checkpoint(path, model=make_run(1)[0], expected_config=only_lr_changed, strict_config_keys=["model", "seed"])
    assert load_checkpoint(path, model=make_run(1)[0]).meta["config"] == config
    # a key the saving version did not have: matches while its feature is off, named once it is on
    newer = {**config, "distill": {"top_k": 0, "teachers": {}}}
    load_checkpoint(path, model=make_run(1)[0], expected_config=newer,
                    strict_config_keys=["distill.top_k", "distill.teachers"])
    with pytest.raises(CheckpointError, match="'distill.top_k': saved '<absent>', current 16"):
        load_checkpoint(path, model=make_run(1)[0], expected_config={**config, "distill": {"top_k": 16}},
                        strict_config_keys=["distill.top_k"])


def test_resolve_resume(tmp_path):
    assert resolve_resume("auto", tmp_path / "nothing-yet") is None
    assert resolve_resume("never", tmp_path) is None and resolve_resume("", tmp_path) is None
    run = make_run(seed=0)
    save_run(tmp_path, 1, run)
    second = save_run(tmp_path, 2, run)
    assert resolve_resume("auto", tmp_path) == second
    assert resolve_resume(str(tmp_path / "step_00000001"), tmp_path) == tmp_path / "step_00000001"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(str(tmp_path / "step_00000099"), tmp_path)
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        resolve_resume(str(tmp_path), tmp_path)
