"""A run never destroys another: refusal (RL and SFT, trainer and CLI) with nothing changed, explicit
overwrite, leftovers of interrupted saves cleaned at the next start, resume=auto passing over an unreadable
newest checkpoint and saying so, "resumed from step N (path)", and launcher restarts continuing the run."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from scalerl.cli import main
from scalerl.trainer.rl_trainer import RLTrainer
from scalerl.trainer.run_directory import OutputDirectoryInUse
from scalerl.trainer.sft_trainer import SFTTrainer, train_sft


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with its sha256: what "nothing changed" is checked against."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step RL run with checkpoints at steps 1 and 2 (each test works on a copy)."""
    from scalerl.core.config import load_config
    from tests.trainer.conftest import TINY

    run = tmp_path_factory.mktemp("finished") / "run"
    RLTrainer.from_config(load_config(None, [*TINY, "trainer.total_steps=2", "trainer.save_every=1", "trainer.keep_last=3",
                                 f"trainer.output_dir={run}"])).fit()
    return run


@pytest.fixture
def run(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def test_new_run_into_another_runs_directory_is_refused_and_changes_nothing(run, tiny_config, capsys):
    before = snapshot(run)
    with pytest.raises(OutputDirectoryInUse) as refused:
        RLTrainer.from_config(tiny_config("trainer.total_steps=1"))
    message = str(refused.value)
    for named in ("checkpoints/", "metrics.jsonl", "final/", "trainer.resume=auto", "trainer.overwrite=true"):
        assert named in message
    assert main(["train", *_cli_args(run), "trainer.total_steps=1"]) == 2
    assert "holds another run's outputs" in capsys.readouterr().err
    assert snapshot(run) == before


def _cli_args(run: Path) -> list[str]:
    from tests.trainer.conftest import TINY

    return [*TINY, f"trainer.output_dir={run}"]


def test_overwrite_replaces_the_previous_run(run, tiny_config, capsys):
    RLTrainer.from_config(tiny_config("trainer.total_steps=1", "trainer.overwrite=true")).fit()
    assert "deleted the previous run's checkpoints/, metrics.jsonl, final/" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    assert steps(run) == [0, 1]


def test_resume_auto_continues_and_says_from_where(run, tiny_config, capsys):
    trainer = RLTrainer.from_config(tiny_config("trainer.total_steps=3", "trainer.resume=auto"))
    assert trainer.step == 2
    assert f"resumed from step 2 ({run / 'checkpoints' / 'step_00000002'})" in capsys.readouterr().out


def test_unreadable_newest_meta_falls_back_and_says_so(run, tiny_config, capsys):
    (run / "checkpoints" / "step_00000002" / "meta.json").write_text("{ not json")
    trainer = RLTrainer.from_config(tiny_config("trainer.total_steps=3", "trainer.resume=auto"))
    assert trainer.step == 1
    out, err = capsys.readouterr()
    assert "step_00000002" in err and "unreadable" in err and "falling back to step_00000001" in err
    assert "resumed from step 1" in out


def test_leftovers_of_interrupted_saves_are_cleaned_at_the_next_start(run, tiny_config, capsys):
    root = run / "checkpoints"
    shutil.copytree(root / "step_00000002", root / ".tmp-step_00000003-4242")  # killed mid-save
    shutil.copytree(root / "step_00000001", root / ".del-step_00000001-4242")  # killed mid-prune
    (root / "step_00000002").rename(root / ".old-step_00000002-4242")  # killed between the two renames
    shutil.copytree(run / "final", run / ".tmp-final-4242")  # killed while exporting the model
    shutil.copytree(run / "final", run / ".final.tmp-4242")  # the same, by an earlier scalerl version
    shutil.copytree(root, run / ".del-checkpoints-4242")  # killed while trainer.overwrite=true deleted a run
    trainer = RLTrainer.from_config(tiny_config("trainer.total_steps=3", "trainer.resume=auto"))
    out = capsys.readouterr().out
    assert "cleaned up after an interrupted save" in out and "restored step_00000002" in out
    assert trainer.step == 2
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_a_launcher_restart_continues_only_the_run_its_first_attempt_started(run, tiny_config, tmp_path,
                                                                             monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # as torchrun sets it in a restarted worker
    with pytest.raises(OutputDirectoryInUse):  # `run` was not started by this job: still refused
        RLTrainer.from_config(tiny_config("trainer.total_steps=3"))
    job = f"trainer.output_dir={tmp_path / 'job'}"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the job's first attempt claims its directory
    RLTrainer.from_config(tiny_config("trainer.total_steps=1", job)).fit()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = RLTrainer.from_config(tiny_config("trainer.total_steps=3", job))  # resume=never, as the job was started
    assert trainer.step == 1
    assert "restart 1 of this job" in capsys.readouterr().out


def test_sft_into_another_runs_directory_is_refused(tiny_config, tmp_path):
    cfg = tiny_config("sft.steps=1")
    train_sft(cfg)
    sft_dir = Path(cfg.trainer.output_dir) / "sft"
    before = snapshot(sft_dir)
    with pytest.raises(OutputDirectoryInUse, match=r"checkpoints/, metrics.jsonl, model/"):
        SFTTrainer.from_config(tiny_config("sft.steps=1"))
    assert snapshot(sft_dir) == before
    assert SFTTrainer.from_config(tiny_config("sft.steps=2", "trainer.resume=auto")).step == 1


def test_a_directory_without_run_outputs_is_fine(tiny_config, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # empty: nothing to lose
    (tmp_path / "run" / "notes.txt").write_text("mine")
    RLTrainer.from_config(tiny_config("trainer.total_steps=1"))
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_everything_a_run_writes_follows_the_umask(tiny_config, tmp_path, umask):
    """One policy for weights, optimizer state, meta.json (with the config), metrics and the exported model:
    the umask's (docs/reliability.md, "File permissions")."""
    import importlib.util
    import os
    import stat

    loggers = "[jsonl,tensorboard]" if importlib.util.find_spec("tensorboard") else "[jsonl]"
    previous = os.umask(umask)
    try:
        RLTrainer.from_config(tiny_config("trainer.total_steps=1", f"trainer.logger={loggers}")).fit()
    finally:
        os.umask(previous)
    run = tmp_path / "run"
    paths = [run, *run.rglob("*")]
    names = {p.name for p in paths}
    assert {"model.safetensors", "optimizer.pt", "meta.json", "metrics.jsonl", "config.yaml", "tokenizer.json"} <= names
    for path in paths:
        expected = 0o777 & ~umask if path.is_dir() else 0o666 & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
