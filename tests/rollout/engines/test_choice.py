"""rollout.engine=auto: the rule and its reasons (vLLM's presence simulated either way)."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.rollout.engines import choice as engine_choice
from scalerl.rollout.engines.choice import (
    VLLM_CPU_MIN_TOKENS_PER_STEP,
    VLLM_MIN_PARAMETERS,
    choose_engine,
    decide_engine,
    generated_tokens_per_engine,
)


@pytest.fixture
def vllm_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(engine_choice.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(engine_choice.torch.cuda, "is_available", lambda: False)


class Big(torch.nn.Module):
    """Parameter count of a large model without its memory (meta tensors), head_dim 64."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(VLLM_MIN_PARAMETERS, device="meta"))
        self.config = ModelConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


def test_auto_rule_and_reasons(vllm_installed):
    tiny = build_model(ModelConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1), seed=0)
    engine, why = choose_engine(tiny, "colocated", 1)
    assert engine == "builtin" and "parameters <" in why
    assert choose_engine(Big(), "colocated", 1)[0] == "vllm"
    assert choose_engine(Big(), "standalone", 4)[0] == "vllm"
    engine, why = choose_engine(Big(), "colocated", 2)
    assert engine == "builtin" and "one trainer rank" in why
    narrow = Big()
    narrow.config = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    engine, why = choose_engine(narrow, "colocated", 1)
    assert engine == "builtin" and "head_dim 16" in why


def test_auto_on_cpu_weighs_the_per_step_load_against_the_tokens(vllm_installed, monkeypatch):
    """On CPU a large model goes to vLLM only when an engine generates enough tokens per step to pay for
    loading the weights into it every step; on a GPU the size alone decides."""
    engine, why = choose_engine(Big(), "colocated", 1, VLLM_CPU_MIN_TOKENS_PER_STEP - 1)
    assert engine == "builtin" and f"{VLLM_CPU_MIN_TOKENS_PER_STEP - 1} generated tokens per step" in why
    engine, why = choose_engine(Big(), "standalone", 1, VLLM_CPU_MIN_TOKENS_PER_STEP)
    assert engine == "vllm" and f"{VLLM_CPU_MIN_TOKENS_PER_STEP} tokens per step per engine" in why
    monkeypatch.setattr(engine_choice.torch.cuda, "is_available", lambda: True)
    assert choose_engine(Big(), "colocated", 1, 1)[0] == "vllm"


def test_tokens_per_engine_from_the_config_trainer_and_workers_decide_alike(vllm_installed):
    from scalerl.core.config import load_config

    rows = ["trainer.batch_size=4", "rollout.n=8", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size=8",
            "rollout.engine=auto"]
    cfg = load_config(None, [*rows, f"rollout.max_new_tokens={VLLM_CPU_MIN_TOKENS_PER_STEP // 32}"])
    assert generated_tokens_per_engine(cfg) == VLLM_CPU_MIN_TOKENS_PER_STEP
    choice = decide_engine(cfg, Big(), world_size=1)
    assert choice.name == "vllm" and choice.decided and "tokens per step per engine" in choice.why
    two_workers = load_config(None, [*rows, f"rollout.max_new_tokens={VLLM_CPU_MIN_TOKENS_PER_STEP // 32}",
                                     "rollout.placement=standalone", "rollout.workers=2"])
    assert generated_tokens_per_engine(two_workers) == VLLM_CPU_MIN_TOKENS_PER_STEP // 2  # each worker half
    # standalone: the trainer and each worker ask with the same inputs (the world's size counts only colocated)
    assert decide_engine(two_workers, Big(), world_size=3) == decide_engine(two_workers, Big(), world_size=3)
    assert decide_engine(two_workers, Big(), world_size=3).name == "builtin"
    explicit = decide_engine(load_config(None, ["rollout.engine=vllm"]), Big(), 1)  # explicit: as given
    assert explicit.name == "vllm" and not explicit.decided and explicit.why == "as configured"


def test_auto_without_vllm(monkeypatch):
    monkeypatch.setattr(engine_choice.importlib.util, "find_spec", lambda name, *a: None)
    assert choose_engine(Big(), "colocated", 1) == ("builtin", "vLLM is not installed")


def test_auto_in_a_run_picks_and_says(tiny_config, capsys):
    from scalerl.core.config import load_config
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer.from_config(load_config(None, ["rollout.engine=auto", "trainer.total_steps=1",
                                                       f"trainer.output_dir={tiny_config}"]))
    # the decision is a field of the trainer, used by its engine, its sources and the precision rule; the
    # config keeps what the user wrote
    assert trainer.engine_choice.name == "builtin" and trainer.cfg.rollout.engine == "auto"
    assert isinstance(trainer.engine, BuiltinEngine)
    assert "rollout.engine=auto: builtin (" in capsys.readouterr().out
    trainer.close()


@pytest.fixture
def tiny_config(tmp_path):
    return tmp_path / "run"


def test_vllm_tensor_parallel_refused_where_it_cannot_run(tmp_path, monkeypatch):
    """rollout.vllm_tensor_parallel_size: an error on CPU (before vLLM is imported or started), beyond the
    visible GPUs, and with the built-in engine (where it would do nothing)."""
    from scalerl.core.config import ConfigError, load_config
    from scalerl.core.errors import UserError
    from scalerl.rollout.engines.vllm import VLLMEngine, vllm_engine_from_config

    with pytest.raises(ConfigError, match="rollout.vllm_tensor_parallel_size=2 applies to vLLM only"):
        load_config(None, ["rollout.vllm_tensor_parallel_size=2"])
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2", "model.hidden_size=128",
                             "model.num_attention_heads=2", "model.num_key_value_heads=1"])
    model = build_model(ModelConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1), seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"rollout.vllm_tensor_parallel_size=2: vLLM's CPU build"):
        vllm_engine_from_config(model, cfg, tmp_path, pad_token_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="more than the 1 GPUs visible"):
        VLLMEngine(str(tmp_path / "vllm_initial_weights"), 0, tensor_parallel_size=2)


def test_the_trainer_the_precision_rule_and_the_workers_take_one_decision(vllm_installed, monkeypatch, tmp_path):
    """`decide_engine` is asked once by the trainer (before trainer.precision=auto reasons about the engine)
    and its answer is what the precision rule, the engine built and the sources see; a worker asks with the
    same inputs and gets the same answer."""
    from scalerl.core.config import load_config
    from scalerl.trainer import rl_trainer
    from scalerl.trainer.rl_trainer import RLTrainer

    asked = []

    def decide(cfg, model, world_size):  # vLLM for this run, whatever the model: the rule is tested above
        asked.append((cfg.rollout.engine, world_size))
        return engine_choice.EngineChoice("vllm", "test", cfg.rollout.engine)

    monkeypatch.setattr(rl_trainer, "decide_engine", decide)
    cfg = load_config(None, ["rollout.engine=auto", "rollout.placement=standalone", "trainer.total_steps=1",
                             f"trainer.output_dir={tmp_path}"])
    trainer = RLTrainer.__new__(RLTrainer)  # only the decisions, not a run
    trainer.cfg, trainer.dist = cfg, SimpleNamespace(world_size=1, dims=SimpleNamespace(dp_shard=1, tp=1, pp=1))
    trainer.device = torch.device("cpu")
    trainer.model_loaded(torch.nn.Linear(2, 2))
    assert asked == [("auto", 1)] and trainer.engine_choice.name == "vllm"
    assert trainer.bf16_recompute_reason(torch.nn.Linear(2, 2)) == "rollout.engine=vllm generates in its own numerics"
    assert len(asked) == 1  # the precision rule read the decision, it did not decide again
