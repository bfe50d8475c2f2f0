"""The `scalerl` command line, run in-process with the heavy commands replaced by fakes."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from scalerl.cli import main
from scalerl.core.config import Config, ConfigError, split_config_args


def fake_module(monkeypatch, name: str, **functions) -> None:
    """Install a stand-in for a lazily imported module."""
    module = types.ModuleType(name)
    for attr, fn in functions.items():
        setattr(module, attr, fn)
    monkeypatch.setitem(sys.modules, name, module)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "sft", "demo", "generate", "config", "version"):
        assert command in out
    assert "actor.lr=1e-6" in out  # the override syntax is explained


def test_subcommand_help_explains_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "key=value" in out and "scalerl train run.yaml" in out


def test_train_loads_config_and_calls_trainer(tmp_path, monkeypatch, capsys):
    calls = []
    fake_module(monkeypatch, "scalerl.trainer.rl_trainer", train=calls.append)
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  lr: 1e-5\nrollout:\n  n: 4\n")
    assert main(["train", str(path), "rollout.n=2", "actor.ppo_mini_batch_size=32"]) == 0
    (cfg,) = calls
    assert isinstance(cfg, Config)
    assert cfg.actor.lr == 1e-5 and cfg.rollout.n == 2
    out = capsys.readouterr().out  # a short banner, not the ~190 lines of the resolved config
    assert out.splitlines() == [
        "scalerl train",
        "  model:     built-in (hidden_size=128, num_hidden_layers=2)",
        "  data:      the built-in arithmetic task (4000 rows); reward auto",
        "  layout:    1 rank",
        "  engine:    rollout.engine=builtin",
        "  precision: trainer.precision=fp32",
        "  changed:   rollout.n=2 actor.lr=1e-05 actor.ppo_mini_batch_size=32",  # in the config's order
        "  config:    outputs/run/config.yaml (every key; --print-config prints it here)"]
    assert main(["train", "--print-config", str(path), "rollout.n=2", "actor.ppo_mini_batch_size=32"]) == 0
    assert capsys.readouterr().out.startswith("resolved config:\n  model:\n")  # every key, as before


def test_sft_and_demo_call_their_targets(monkeypatch):
    calls = {}
    fake_module(monkeypatch, "scalerl.trainer.sft_trainer", train_sft=lambda cfg: calls.setdefault("sft", cfg))
    fake_module(monkeypatch, "scalerl.demo", run_demo=lambda cfg: calls.setdefault("demo", cfg))
    assert main(["sft", "sft.steps=5"]) == 0
    assert main(["demo", "trainer.total_steps=3"]) == 0
    assert calls["sft"].sft.steps == 5
    assert calls["demo"].trainer.total_steps == 3


def test_config_error_exits_2_naming_the_key(monkeypatch, capsys):
    fake_module(monkeypatch, "scalerl.trainer.rl_trainer", train=lambda cfg: pytest.fail("must not start"))
    assert main(["train", "actor.lrr=1e-6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'actor.lrr'" in err and "actor.lr" in err
    assert "Traceback" not in err
    assert main(["train", "actor.ppo_mini_batch_size=48"]) == 2
    assert "actor.ppo_mini_batch_size" in capsys.readouterr().err


def test_config_checks_what_the_config_names(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")  # `scalerl config` runs nothing, so it checks as `train` would
    assert main(["config", f"trainer.output_dir={tmp_path / 'taken'}"]) == 2
    assert "trainer.output_dir" in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["config", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "actor.lr=3e-6", "rollout.n=4"]) == 0
    out = capsys.readouterr().out
    assert "lr: 3.0e-06" in out and "n: 4" in out
    assert main(["config", "--keys"]) == 0
    assert "actor.clip_ratio_high" in capsys.readouterr().out


def test_split_config_args(tmp_path):
    existing = tmp_path / "cfg.txt"
    existing.write_text("{}")
    assert split_config_args(["a.yaml", "x.y=1"]) == ("a.yaml", ["x.y=1"])
    assert split_config_args([str(existing)]) == (str(existing), [])
    assert split_config_args(["x.y=1"]) == (None, ["x.y=1"])
    with pytest.raises(ConfigError, match="must come first"):
        split_config_args(["x.y=1", "b.yml"])
    with pytest.raises(ConfigError, match="neither a YAML config file"):
        split_config_args(["oops"])


def test_generate_prints_prompt_and_completion(monkeypatch, capsys):
    seen = {}

    def generate_text(model_path, prompts, **kwargs):
        seen.update(model_path=model_path, kwargs=kwargs)
        return [f" -> {p[::-1]}" for p in prompts]

    fake_module(monkeypatch, "scalerl.rollout.text", generate_text=generate_text)
    assert main(["generate", "--model", "builtin", "--prompt", "ab", "--prompt", "cd",
                 "--max-new-tokens", "5", "--temperature", "0.7", "--top-k", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "ab -> ba" in out and "cd -> dc" in out
    assert seen["model_path"] == "builtin"
    assert seen["kwargs"] == dict(max_new_tokens=5, temperature=0.7, top_p=1.0, top_k=3, seed=1)


def test_generate_rejects_bad_sampling(capsys):
    assert main(["generate", "--model", "builtin", "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err


def test_generate_at_a_temperature_that_underflows_is_greedy(capsys):
    """`--temperature 1e-45` once printed an empty completion (logits / 1e-45 overflows: NaN probabilities)."""
    def generate(*temperature: str) -> str:
        assert main(["generate", "--model", "builtin", "--prompt", "12+30=", "--max-new-tokens", "8",
                     *temperature]) == 0
        return capsys.readouterr().out

    greedy = generate()  # the default: 0
    assert generate("--temperature", "1e-45") == greedy
    assert greedy.splitlines()[1].startswith("12+30=") and len(greedy.splitlines()[1]) > len("12+30=")


def test_version_prints_torch_version(capsys):
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out and "scalerl" in out
    assert ("CUDA: not available" in out) != torch.cuda.is_available()


@pytest.mark.parametrize("command", [["config", "--keys"], ["--help"], ["train", "--help"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(command):
    # `scalerl config --keys | head -2`: the pipe closes while scalerl still writes
    reader = subprocess.Popen(["head", "-2"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    writer = subprocess.run([sys.executable, "-m", "scalerl", *command], stdout=reader.stdin, stderr=subprocess.PIPE,
                            text=True, check=False, timeout=120)
    reader.stdin.close()
    reader.wait(timeout=30)
    assert writer.returncode == 0 and writer.stderr == ""  # no BrokenPipeError traceback


def test_ctrl_c_before_the_first_step_is_one_line(monkeypatch, capsys):
    def interrupted(cfg):
        raise KeyboardInterrupt  # as Ctrl-C while the model loads (the loop's own handler is not set yet)

    fake_module(monkeypatch, "scalerl.trainer.rl_trainer", train=interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "interrupted: stopped at once, nothing saved by this run\n"
