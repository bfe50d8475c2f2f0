"""The built-in tool task's rows: deterministic by seed, operands by level, the ground truth the operator, train
and test disjoint; the data config makes them, and its reward is the exact final answer after the tool."""

import pytest

from scalerl.core.config import load_config
from scalerl.data.errors import DataError
from scalerl.data.prompts import encode_demonstration
from scalerl.data.sources import reward_from_config, rows_from_config
from scalerl.data.tool_arithmetic import (
    LEVEL_RANGES,
    chat_demonstration_sft_rows,
    count_tool_arithmetic_problems,
    final_answer,
    make_tool_arithmetic_rows,
    operator,
    tool_answer_reward,
    tool_arithmetic_row,
    tool_call_text,
    tool_demonstration,
)
from scalerl.models.tokenizer import HFTokenizer
from tests.rollout.agent.chat_templates import LLAMA3, QWEN25, chat_tokenizer


def test_rows_are_deterministic_by_seed_and_differ_between_seeds():
    a = make_tool_arithmetic_rows("train", 50, [1, 2, 3], seed=3)
    assert a == make_tool_arithmetic_rows("train", 50, [1, 2, 3], seed=3)
    assert [r["prompt"] for r in a] != [r["prompt"] for r in make_tool_arithmetic_rows("train", 50, [1, 2, 3], seed=4)]
    assert len({r["prompt"] for r in a}) == 50  # distinct problems


@pytest.mark.parametrize("level", sorted(LEVEL_RANGES))
def test_each_level_has_its_operand_sizes_and_the_ground_truth_is_the_operator(level):
    low, high = LEVEL_RANGES[level]
    for row in make_tool_arithmetic_rows("test", 20, level, seed=0):
        a, b = row["operands"]
        assert low <= a <= high and low <= b <= high and row["difficulty"] == level
        assert row["prompt"] == f"Q:{a}@{b}\nA:"
        assert row["ground_truth"] == str(a * b + a + b) == str(operator(a, b))
        assert row["response"] == f" #### {row['ground_truth']}"


def test_train_and_test_never_share_a_problem_and_levels_share_out_rows():
    train = {r["prompt"] for r in make_tool_arithmetic_rows("train", 2000, [1, 2], seed=0)}
    test = {r["prompt"] for r in make_tool_arithmetic_rows("test", 500, [1, 2], seed=0)}
    assert not train & test
    level_1 = count_tool_arithmetic_problems("train", 1)
    assert 60 < level_1 < 95  # about 80% of the 100 single-digit problems
    rows = make_tool_arithmetic_rows("train", 400, [1, 2], seed=0)
    assert sum(r["difficulty"] == 1 for r in rows) == level_1  # level 1 runs out, level 2 takes the rest
    with pytest.raises(DataError, match="only"):
        make_tool_arithmetic_rows("train", level_1 + 1, 1, seed=0)
    with pytest.raises(DataError, match="level"):
        make_tool_arithmetic_rows("train", 5, 4, seed=0)
    with pytest.raises(DataError, match="split"):
        make_tool_arithmetic_rows("val", 5, 1, seed=0)


def test_the_data_config_makes_the_task_and_scores_it_with_its_own_reward():
    cfg = load_config(None, ["data.task=tool_arithmetic", "data.difficulty=[2]", "data.num_train=30",
                             "data.num_val=10"])
    train, test = rows_from_config(cfg.data, "train", 1), rows_from_config(cfg.data, "test", 1)
    assert train == make_tool_arithmetic_rows("train", 30, [2], 1) and len(test) == 10
    reward = reward_from_config(cfg.data)  # data.reward=auto: the task's final-answer reward
    row = train[0]
    call = tool_call_text(*row["operands"])
    right = f"{call}{row['ground_truth']} #### {row['ground_truth']}"
    scores, _ = reward.compute([right, f"{call}{row['ground_truth']}"], [row, row])
    assert scores == [1.0, 0.0]


def test_the_final_answer_is_the_one_after_the_last_tool_call():
    assert tool_answer_reward(' #### 11', "11") == 1.0  # answered without the tool: still scored
    assert tool_answer_reward('<tool_call>{"name":"op","arguments":{"a":1,"b":5}}</tool_call>11 #### 11', "11") == 1.0
    assert tool_answer_reward('<tool_call>{"name":"op","arguments":{"a":1,"b":5}}</tool_call>11 #### 12', "11") == 0.0
    # a "####" before (or inside) the last call is not the final answer
    assert final_answer('#### 11<tool_call>{"name":"op","arguments":{"a":"#### 11"}}</tool_call>11') is None
    assert tool_answer_reward("#### 11<tool_call>{}</tool_call>", "11") == 0.0


# ---- SFT rows through a chat template (their layout against the agent loop's: tests/rollout/agent/test_tool_task.py)

def _with_bos(tokenizer: HFTokenizer, bos: str) -> HFTokenizer:
    return HFTokenizer(tokenizer.backend, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.backend.token_to_id(bos), chat_template=tokenizer.chat_template)


def test_chat_rows_leave_out_the_bos_the_sft_trainer_adds_and_reject_one_the_template_never_renders():
    messages = tool_demonstration(tool_arithmetic_row(47, 38))
    llama = _with_bos(chat_tokenizer(LLAMA3), "<|begin_of_text|>")  # the template begins with the BOS
    rows = chat_demonstration_sft_rows(messages, llama)
    assert [r["response"] for r in rows] == [messages[1]["content"], messages[3]["content"]]
    assert not rows[0]["prompt"].startswith("<|begin_of_text|>")  # the trainer's BOS stands in for it
    prompt, _ = encode_demonstration(llama, rows[0], chat_template=False)
    assert prompt == llama.encode(llama.apply_chat_template(messages[:1], add_generation_prompt=True))
    qwen = _with_bos(chat_tokenizer(QWEN25), "<bos>")  # a BOS the template never renders: SFT would add one
    with pytest.raises(DataError, match="does not encode the rendered text as the agent loop lays out"):
        chat_demonstration_sft_rows(messages, qwen)


def test_chat_rows_name_a_conversation_the_agent_loop_cannot_lay_out():
    tok = chat_tokenizer(QWEN25)
    user, call, result, answer = tool_demonstration(tool_arithmetic_row(4, 7))
    with pytest.raises(DataError, match="follows another assistant turn"):
        chat_demonstration_sft_rows([user, call, answer], tok)
    with pytest.raises(DataError, match="before its first assistant turn"):
        chat_demonstration_sft_rows([call, result, answer], tok)
    assert len(chat_demonstration_sft_rows([user, call, result, answer, result], tok)) == 2  # a trailing result
