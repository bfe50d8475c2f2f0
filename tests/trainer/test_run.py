"""The run scaffold: one checked entry (`start_run`) for both trainers, and the seams a harness uses instead
of patching a trainer's members (``timer=``, ``wrap_optimizer_step=``, ``on_batch=``)."""

import sys

import pytest
import torch

from scalerl.core.config import ConfigError
from scalerl.perf.timing import StepTimer
from scalerl.trainer.rl_trainer import RLTrainer, train
from scalerl.trainer.run import start_run
from scalerl.trainer.sft_trainer import SFTTrainer, train_sft


class RecordingTimer(StepTimer):
    """A StepTimer that also lists the sections it timed, in order."""

    def __init__(self, device):
        super().__init__(device)
        self.sections: list[str] = []

    def __call__(self, name):
        self.sections.append(name)
        return super().__call__(name)


class CountedOptimizerStep:
    """Counts the optimizer steps it passes on; forwards everything else, as the doctor's wrapper does."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def __getattr__(self, name):
        return getattr(self.step, name)

    def __call__(self, parts):
        self.calls += 1
        return self.step(parts)


def test_rl_seams_see_the_step(tiny_config, length_reward):
    cfg = tiny_config(length_reward)
    timer, wrapped, batches = RecordingTimer(torch.device("cpu")), [], []

    def wrap(step):
        wrapped.append(CountedOptimizerStep(step))
        return wrapped[0]

    trainer = RLTrainer.from_config(cfg, timer=timer, wrap_optimizer_step=wrap, on_batch=batches.append)
    assert trainer.timer is timer and trainer.optimizer_step is wrapped[0]
    metrics = trainer.train_step()
    assert timer.sections[:3] == ["data", "gen", "reward"] and "update_actor" in timer.sections
    assert wrapped[0].calls == cfg.trainer.batch_size * cfg.rollout.n // cfg.actor.ppo_mini_batch_size
    (batch,) = batches
    assert batch.advantages is not None and batch.advantages.shape == batch.response_mask.shape
    assert batch.old_logprobs is not None
    assert "timing_s/adv" in metrics and metrics["timing_s/step"] > 0


def test_sft_seams_and_step_tail(tiny_config):
    timer = RecordingTimer(torch.device("cpu"))
    trainer = SFTTrainer.from_config(tiny_config(), timer=timer, wrap_optimizer_step=CountedOptimizerStep)
    metrics = trainer.train_step()
    assert timer.sections == ["data", "update"]
    assert trainer.optimizer_step.calls == 1  # one mini-batch per SFT step
    assert {"sft/loss", "sft/lr", "perf/cpu_threads", "timing_s/step", "perf/throughput", "perf/mfu",
            "perf/max_memory_gb"} <= set(metrics)
    assert "perf/total_num_tokens" not in metrics  # SFT's perf/* keys stay as they were


@pytest.mark.parametrize("entry", [train, train_sft, RLTrainer.from_config, SFTTrainer.from_config])
def test_the_entry_validates_a_config_edited_in_code(tiny_config, entry, tmp_path):
    cfg = tiny_config()
    cfg.rollout.n = 1  # load_config checked the text; an edit after it is caught at the entry
    with pytest.raises(ConfigError, match="rollout.n must be >= 2"):
        entry(cfg)
    assert not (tmp_path / "run").exists()  # before anything was written


def test_the_entry_checks_what_the_config_names(tiny_config, tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError, match="trainer.output_dir.*is a file"):
        start_run(tiny_config(f"trainer.output_dir={tmp_path / 'taken'}"), "rl")
    with pytest.raises(ConfigError, match="sft.output_dir.*is a file"):
        start_run(tiny_config(f"sft.output_dir={tmp_path / 'taken'}"), "sft")
    start_run(tiny_config(f"sft.output_dir={tmp_path / 'taken'}"), "rl")  # RL does not write there


def test_a_run_refused_for_a_missing_vllm_writes_nothing(tmp_path, monkeypatch, capsys):
    from scalerl.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is not installed
    run = tmp_path / "run"
    verl = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.name=vllm",
            "data.max_prompt_length=32", "data.max_response_length=8", "trainer.total_training_steps=1",
            f"trainer.default_local_dir={run}"]
    assert main(["train", "--from-verl", *verl, "--", "model.hidden_size=32", "model.intermediate_size=64"]) == 2
    assert "rollout.engine=vllm needs vLLM, which is not installed" in capsys.readouterr().err
    assert not run.exists()  # no claim file, no vllm_initial_weights/
