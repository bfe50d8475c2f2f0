"""MetricsLogger backends: jsonl lines and resume, TensorBoard scalars, console lines, config, errors."""

import io
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from scalerl.tracking import (
    ConsoleBackend,
    JsonlBackend,
    MetricsLogger,
    read_metrics_jsonl,
)


def jsonl_steps(path: Path) -> list[int]:
    return [record["step"] for record in read_metrics_jsonl(path)]


def test_jsonl_writes_one_object_per_step(tmp_path):
    with MetricsLogger(tmp_path, backends=["jsonl"]) as logger:
        logger.log({"critic/score/mean": torch.tensor(0.5), "note": "warmup", "obj": object()}, step=1)
        logger.log({"critic/score/mean": 0.75}, step=2)
        # flushed per step: readable before close
        assert jsonl_steps(tmp_path / "metrics.jsonl") == [1, 2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "critic/score/mean": 0.5, "note": "warmup"}
    assert json.loads(lines[1]) == {"step": 2, "critic/score/mean": 0.75}


def test_jsonl_resume_drops_steps_from_resume_step_and_appends(tmp_path):
    with MetricsLogger(tmp_path, backends="jsonl") as logger:
        for step in range(1, 6):
            logger.log({"x": float(step)}, step=step)
    with MetricsLogger(tmp_path, backends="jsonl", resume_step=3) as logger:
        assert jsonl_steps(tmp_path / "metrics.jsonl") == [1, 2]
        logger.log({"x": 30.0}, step=3)
    assert jsonl_steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    assert read_metrics_jsonl(tmp_path / "metrics.jsonl")[-1]["x"] == 30.0


def test_jsonl_tolerates_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')  # crash mid-write
    backend = JsonlBackend(tmp_path)
    backend.log({"x": 2.0}, step=2)
    backend.close()
    assert jsonl_steps(path) == [1, 2]
    backend.truncate_after(1)
    assert path.read_text() == '{"step": 1, "x": 1.0}\n'


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, backends=("tensorboard",)) as logger:
        logger.log({"critic/score/mean": 0.25, "note": "text is skipped"}, step=1)
        logger.log({"critic/score/mean": 0.5}, step=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["critic/score/mean"]
    scalars = events.Scalars("critic/score/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.5)]


def test_console_prints_plain_key_metric_lines_when_not_a_tty(tmp_path, capsys, caplog):
    with caplog.at_level(logging.DEBUG, logger="scalerl.tracking"):
        with MetricsLogger(tmp_path, backends=["console"], total_steps=20) as logger:
            logger.log({"critic/score/mean": 0.41, "timing_s/step": 1.2, "actor/grad_norm": 3.0}, step=3)
    out = capsys.readouterr().out
    assert out == "step 3/20 | critic/score/mean=0.41 | timing_s/step=1.2\n"
    assert "actor/grad_norm=3" in caplog.text  # every metric at debug level


def test_console_progress_bar_shows_key_metrics():
    from rich.console import Console

    buffer = io.StringIO()
    backend = ConsoleBackend(total_steps=4, mode="progress", console=Console(file=buffer, force_terminal=True, width=150))
    backend.log({"critic/score/mean": 0.41, "timing_s/step": 1.2}, step=2)
    backend.close()
    assert "2/4" in buffer.getvalue() and "critic/score/mean=0.41" in buffer.getvalue()


def test_config_yaml_is_written(tmp_path):
    @dataclass
    class Optim:
        lr: float = 1e-6
        betas: tuple = (0.9, 0.99)

    config = {"model": {"path": Path("/models/qwen")}, "optim": Optim()}
    MetricsLogger(tmp_path, backends=[], config=config).close()
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {
        "model": {"path": "/models/qwen"},
        "optim": {"lr": 1e-6, "betas": [0.9, 0.99]},
    }


def test_unknown_backend_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="valid backends are .*'jsonl'.*'tensorboard'"):
        MetricsLogger(tmp_path, backends=["jsonl", "neptune"])


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_missing_service_package_names_pip_command(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail even if installed
    with pytest.raises(ImportError, match=f"pip install {package}"):
        MetricsLogger(tmp_path, backends=["jsonl", package])


def test_log_after_close_is_an_error(tmp_path):
    logger = MetricsLogger(tmp_path, backends=["jsonl"])
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log({"x": 1.0}, step=1)


def test_default_backends_are_console_jsonl_tensorboard(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=2) as logger:
        assert list(logger.backends) == ["console", "jsonl", "tensorboard"]
        logger.log({"critic/score/mean": 0.5}, step=1)
    assert capsys.readouterr().out.startswith("step 1/2 | critic/score/mean=0.5")
    assert (tmp_path / "metrics.jsonl").exists() and any((tmp_path / "tensorboard").iterdir())


def test_default_tensorboard_is_skipped_with_a_warning_when_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.warns(UserWarning, match="pip install tensorboard"):
        logger = MetricsLogger(tmp_path, console_mode="plain")
    assert list(logger.backends) == ["console", "jsonl"]
    logger.close()
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsLogger(tmp_path, backends=["tensorboard"])


def test_plain_console_thins_long_runs_to_about_twenty_lines(capsys):
    from scalerl.tracking.console_backend import ConsoleBackend

    console = ConsoleBackend(total_steps=1000, mode="plain")
    for step in range(1, 1001):
        console.log({"critic/score/mean": 0.5, **({"val/accuracy": 0.1} if step == 333 else {})}, step)
    lines = capsys.readouterr().out.splitlines()
    assert 20 <= len(lines) <= 24
    assert lines[0].startswith("step 1/1000") and lines[-1].startswith("step 1000/1000")
    assert any(line.startswith("step 333/1000") for line in lines)  # evaluation steps always show
