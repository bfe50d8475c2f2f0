"""The demo pipeline end to end at toy size (the real demo's numbers are measured in the README)."""

import json

import pytest

from scalerl.cli import DEMO_CONFIG, main
from scalerl.core.config import ConfigError, load_config
from scalerl.data.arithmetic import count_arithmetic_problems, make_arithmetic_rows
from scalerl.demo import AGENT_DEMO_CONFIG, run_agent_demo, weak_teacher_rows
from tests.tiny import tiny_overrides


def test_weak_teacher_errs_at_the_configured_rate():
    rows = [{"prompt": f"Q:{i}+0\nA:", "response": f" #### {i}", "ground_truth": str(i)} for i in range(2000)]
    taught = weak_teacher_rows(rows, 0.6, seed=0)
    wrong = [r for r in taught if not r["response"].endswith(f"#### {r['ground_truth']}")]
    assert 0.55 < len(wrong) / len(rows) < 0.65
    assert all(r["response"].endswith(f"#### {int(r['ground_truth']) + 1}") for r in wrong)
    assert [r["ground_truth"] for r in taught] == [r["ground_truth"] for r in rows]


def test_demo_command_runs_sft_then_grpo(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", *tiny_overrides("actor.ppo_micro_batch_size=8"), f"trainer.output_dir={out}"])
    assert code == 0
    result = json.loads((out / "demo_result.json").read_text())
    assert 0 <= result["heldout_accuracy_sft"] <= 1 and 0 <= result["heldout_accuracy_grpo"] <= 1
    assert (out / "grpo" / "metrics.png").is_file() and (out / "sft" / "model" / "model.safetensors").is_file()
    assert "held-out accuracy after GRPO" in capsys.readouterr().out


def test_demo_teaches_on_most_of_the_distinct_training_problems():
    # The demo's SFT learns the sums only from most of the problems (with 4,000 of 9,840, seed 2's SFT model
    # erred at random on unseen ones and GRPO gained 4 points); more than there are would fail to load.
    cfg = load_config(DEMO_CONFIG)
    levels = sorted(set(cfg.data.difficulty))
    available = sum(count_arithmetic_problems("train", level) for level in levels)
    assert 0.9 * available <= cfg.data.num_train <= available
    rows = make_arithmetic_rows("train", cfg.data.num_train, list(cfg.data.difficulty), seed=2)
    assert len({r["prompt"] for r in rows}) == cfg.data.num_train


# ---- `scalerl demo --agent` (SFT on tool-use demonstrations, then GRPO with the tool environment) at toy size,
# and its baseline without the tool (the measured numbers are in docs/rollout.md)
TOY = tiny_overrides("data.num_train=32", "data.num_val=4", "actor.ppo_micro_batch_size=8", "trainer.total_steps=1",
                     "sft.steps=2", "rollout.max_new_tokens=8")


def test_demo_agent_runs_sft_then_grpo_with_the_tool(tmp_path, capsys):
    out = tmp_path / "agent"
    assert main(["demo", "--agent", *TOY, f"trainer.output_dir={out}"]) == 0
    result = json.loads((out / "demo_result.json").read_text())
    assert result["use_tool"] is True
    assert 0 <= result["heldout_accuracy_sft"] <= 1 and 0 <= result["heldout_accuracy_grpo"] <= 1
    demos = [json.loads(line) for line in (out / "data" / "teacher_demonstrations.jsonl").read_text().splitlines()]
    assert len(demos) == 2 * 32 and demos[0]["response"].startswith("<tool_call>")  # the call, then the answer
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("agent/turns/mean" in m for m in metrics)  # GRPO ran episodes with the tool environment
    assert (out / "grpo" / "final" / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "held-out accuracy after GRPO" in printed and "with the tool" in printed


def test_the_baseline_runs_the_same_pipeline_without_the_tool(tmp_path):
    cfg = load_config(AGENT_DEMO_CONFIG, [*TOY, f"trainer.output_dir={tmp_path / 'plain'}"])
    result = run_agent_demo(cfg, use_tool=False)
    assert result["use_tool"] is False and result["tool_call_rate_grpo"] == 0
    demos = (tmp_path / "plain" / "data" / "teacher_demonstrations.jsonl").read_text()
    assert "<tool_call>" not in demos and len(demos.splitlines()) == 32
    metrics = [json.loads(line) for line in (tmp_path / "plain" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert not any("agent/turns/mean" in m for m in metrics)  # single-turn GRPO


def _chat_model_dir(path):
    """A Qwen2-architecture model (random weights, 1024 positions) with a Qwen2.5-style chat template's tokenizer
    (tests/rollout/agent/chat_templates.py), as a model directory."""
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.models.hf_checkpoint import save_pretrained
    from tests.rollout.agent.chat_templates import QWEN25, chat_tokenizer

    tok = chat_tokenizer(QWEN25)
    save_pretrained(build_model(ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), seed=0),
                    path)
    tok.save_pretrained(path)
    return path


def test_demo_agent_runs_on_a_chat_template_model_with_rows_as_the_agent_loop_lays_them_out(tmp_path, monkeypatch):
    """``model.path`` a Qwen2-architecture model with a Qwen2.5-style chat template (random weights, the template
    written by the tests): the teacher's rows are rendered through the template, and the examples SFT trains on
    (spied on where the trainer encodes them) are the agent loop's tokens for the same conversation, never
    templated twice; GRPO then runs its episodes with the tool environment on that model."""
    from scalerl.rollout.agent.chat_delta import ChatContinuity
    from scalerl.rollout.agent.tools import tools_from_module
    from scalerl.trainer import sft_trainer
    from tests.rollout.agent.chat_templates import QWEN25, chat_tokenizer

    tok = chat_tokenizer(QWEN25)
    model_dir = _chat_model_dir(tmp_path / "qwen-chat")
    encoded = []

    def spy(tokenizer, rows, chat_template, *args, **kwargs):
        examples = encode_demonstrations(tokenizer, rows, chat_template, *args, **kwargs)
        encoded.append((chat_template, rows, examples))
        return examples

    encode_demonstrations = sft_trainer.encode_demonstrations
    monkeypatch.setattr(sft_trainer, "encode_demonstrations", spy)
    out = tmp_path / "agent"
    cfg = load_config(AGENT_DEMO_CONFIG, [*TOY, "data.max_prompt_length=512", "rollout.max_new_tokens=16",
                                          f"model.path={model_dir}", f"trainer.output_dir={out}"])
    result = run_agent_demo(cfg)
    assert result["use_tool"] is True and 0 <= result["heldout_accuracy_grpo"] <= 1

    [(chat_template, rows, examples)] = encoded
    assert chat_template is False  # the rows are rendered already
    continuity = ChatContinuity(tok, [t.schema() for t in tools_from_module(cfg.rollout.agent.tools)])
    teacher = [json.loads(line) for line in (out / "data" / "teacher_demonstrations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in teacher[:len(rows)]] and len(rows) == len(examples)
    for k in range(len(rows) // 2):  # each problem's two turns: the call, then the answer after the tool's result
        user, call, tool_result, answer = teacher[2 * k]["messages"]
        call_ids = tok.encode(call["content"]) + [tok.eos_token_id]
        first = continuity.prompt([user])
        answer_prompt = first + call_ids + continuity.continuation([tool_result], call_ids[-1]).token_ids
        assert examples[2 * k] == (first, call_ids)
        assert examples[2 * k + 1] == (answer_prompt, tok.encode(answer["content"]) + [tok.eos_token_id])
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    episodes = [m for m in metrics if "agent/turns/mean" in m]
    assert episodes and all(m["agent/prefix_breaks"] == 0 for m in episodes)  # episodes, through the template
    assert (out / "grpo" / "final" / "tokenizer.json").is_file()


def test_demo_agent_on_a_chat_template_model_names_a_budget_its_episodes_do_not_fit(tmp_path):
    """The template's system block (the tool's schema) makes an episode ~500 tokens; the default budget
    (data.max_prompt_length=64 + 2 turns x (16 + 64)) is an error naming the keys, before any training."""
    cfg = load_config(AGENT_DEMO_CONFIG, [*TOY, "rollout.max_new_tokens=16", f"model.path={_chat_model_dir(tmp_path / 'm')}",
                                          f"trainer.output_dir={tmp_path / 'agent'}"])
    with pytest.raises(ConfigError, match=r"budget of 224 \(rollout.agent.max_total_tokens.*raise data.max_prompt_length"):
        run_agent_demo(cfg)
    assert not (tmp_path / "agent" / "sft").exists()
