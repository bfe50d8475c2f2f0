"""The tiny run and the tiny model that tests share: small enough that a few RL steps take about a second
on one CPU core. A test that needs other values states only the keys it changes, where it uses them
(``tiny_overrides("data.num_train=64")``, ``tiny_model(hidden_size=64)``), so the differences are read
in the test and the common part in one place."""

from __future__ import annotations

from scalerl.core.config import load_config
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM, build_model
from scalerl.models.load import builtin_model_config
from scalerl.models.tokenizer import CharTokenizer

# Config overrides: the built-in task and model (hidden 32, 4 heads, 2 kv heads, 2 layers), 2 RL steps of
# 4 prompts x 4 samples, no evaluation between steps, metrics to jsonl only; 3 SFT steps of 8 rows.
TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "data.num_train=200", "data.num_val=8", "rollout.n=4", "rollout.max_new_tokens=8",
    "trainer.batch_size=4", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=4",
    "trainer.total_steps=2", "trainer.eval_every=0", "trainer.logger=[jsonl]",
    "sft.steps=3", "sft.batch_size=8", "sft.micro_batch_size=4",
]


# A tiny MoE decoder's settings (with model_type and the architecture's own keys added by each test): 4 experts,
# top-2, 3 layers.
TINY_MOE_VOCAB = 80
TINY_MOE = dict(vocab_size=TINY_MOE_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, max_position_embeddings=128)


def tiny_overrides(*changes: str) -> list[str]:
    """``TINY`` with each ``key=value`` of ``changes`` in place of that key's value (new keys appended),
    so every key appears once, as a reader of the command line expects."""
    merged = {o.split("=", 1)[0]: o for o in TINY}
    for change in changes:
        merged[change.split("=", 1)[0]] = change
    return list(merged.values())


def tiny_model_config(**changes) -> ModelConfig:
    """The built-in architecture at test size: vocabulary 64, hidden 32, 4 heads over 2 kv heads, 2 layers."""
    return ModelConfig(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, **changes})


def tiny_model(seed: int = 0, **changes) -> CausalLM:
    """A randomly initialised `tiny_model_config(**changes)` model; the same seed gives the same weights."""
    return build_model(tiny_model_config(**changes), seed=seed)


def tiny_run_model(tokenizer: CharTokenizer, seed: int = 0) -> CausalLM:
    """The model a run with ``TINY`` trains: the built-in architecture at TINY's sizes, over the built-in
    tokenizer's vocabulary and positions (what `scalerl train` would build, e.g. to save as a directory)."""
    return build_model(builtin_model_config(load_config(None, TINY).model, tokenizer), seed=seed)


def record_step_rows(trainer, rows: list) -> None:
    """Append each step's data rows (this rank's, one per group) to ``rows`` as the RL trainer's rollout phase
    hands them over, before ``on_batch`` sees the batch."""
    collect = trainer.rollout_phase.collect

    def recording(step):
        collected = collect(step)
        rows.append(list(collected.rows))
        return collected

    trainer.rollout_phase.collect = recording


def save_tiny_teacher(path, seed: int = 7, *changes: str, sharpness: float = 8.0):
    """A model directory a run can load as ``algorithm.distill.teacher``: the built-in architecture over the
    built-in tokenizer (saved with it), at TINY's sizes with ``changes`` (e.g. ``"model.hidden_size=64"``), its
    logits scaled by ``sharpness`` (through the final norm) so that, unlike a freshly initialised student, it
    prefers some tokens strongly: a teacher with something to teach."""
    import torch

    from scalerl.models.hf_checkpoint import save_pretrained

    tokenizer = CharTokenizer()
    model = build_model(builtin_model_config(load_config(None, tiny_overrides(*changes)).model, tokenizer), seed=seed)
    with torch.no_grad():
        model.norm.weight.mul_(sharpness)
    return save_pretrained(model, path, tokenizer=tokenizer)
