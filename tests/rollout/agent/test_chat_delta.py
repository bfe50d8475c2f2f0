"""Token continuity: every later turn appends only the new messages' tokens (and the template's glue), so a
conversation built turn by turn from the engine's own tokens is, token for token, what the template renders
for the whole conversation; where the template rewrites earlier turns the break is counted."""

from __future__ import annotations

import pytest

from scalerl.rollout.agent.chat_delta import ChatContinuity
from tests.rollout.agent.chat_templates import LLAMA3, QWEN3, QWEN25, chat_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def _turn_by_turn(tok, turns, tools=None):
    """The conversation's ids as the agent loop builds them: the first render, then per turn the engine's
    tokens (its content + the end-of-turn token it stops at) and the continuation of the new messages."""
    continuity = ChatContinuity(tok, tools)
    ids = continuity.prompt(turns[0])
    bridged = []
    for assistant, new in turns[1:]:
        generated = tok.encode(assistant) + [tok.eos_token_id]
        ids += generated
        delta = continuity.continuation(new, generated[-1])
        bridged.append(delta.bridged)
        ids += delta.token_ids
    return ids, bridged


@pytest.mark.parametrize("template", [QWEN25, LLAMA3], ids=["qwen2.5", "llama3"])
def test_turn_by_turn_ids_are_the_whole_conversations_render(template):
    tok = chat_tokenizer(template)
    first = [{"role": "user", "content": "What is 3@4?"}]
    turns = [first,
             ('<tool_call>{"name": "calc"}</tool_call>', [{"role": "tool", "content": "17"}]),
             # two tool results in one turn: Qwen groups them into one user turn
             ("two calls", [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]),
             ("thanks", [{"role": "user", "content": "and 5@6?"}])]
    ids, bridged = _turn_by_turn(tok, turns, TOOLS)
    whole = list(first)
    for assistant, new in turns[1:]:
        whole += [{"role": "assistant", "content": assistant}, *new]
    assert ids == tok.encode(tok.apply_chat_template(whole, add_generation_prompt=True, tools=TOOLS))
    assert all(bridged)


def test_qwen_glue_is_the_newline_after_im_end_which_the_engine_does_not_generate():
    tok = chat_tokenizer(QWEN25)
    delta = ChatContinuity(tok).continuation([{"role": "tool", "content": "17"}], tok.eos_token_id)
    assert tok.decode(delta.token_ids, skip_special_tokens=False).startswith("\n<|im_start|>user")
    # a turn cut by the length limit (no <|im_end|> sampled) gets the end of turn too
    cut = ChatContinuity(tok).continuation([{"role": "tool", "content": "17"}], tok.encode("x")[0])
    assert tok.decode(cut.token_ids, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user")


def test_think_blocks_the_engine_sampled_stay_as_sampled():
    """Qwen3 strips <think> from earlier turns when it renders the whole conversation; turn by turn, the
    trained ids keep the reasoning the engine sampled (a re-render would have dropped those tokens)."""
    tok = chat_tokenizer(QWEN3)
    first = [{"role": "user", "content": "q"}]
    sampled = "<think>\nlet me add</think>\ncall"
    ids, bridged = _turn_by_turn(tok, [first, (sampled, [{"role": "tool", "content": "5"}])])
    assert all(bridged) and tok.encode("<think>\nlet me add</think>") == ids[len(ChatContinuity(tok).prompt(first)):][:26]
    rerendered = tok.encode(tok.apply_chat_template(
        [*first, {"role": "assistant", "content": sampled}, {"role": "tool", "content": "5"}], add_generation_prompt=True))
    assert ids != rerendered and "let me add" not in tok.decode(rerendered)


def test_a_template_that_rewrites_the_stand_in_is_counted_as_a_prefix_break():
    tok = chat_tokenizer(QWEN25)
    tok.chat_template = QWEN25.replace("{{ message.content }}<|im_end|>",
                                       "{{ message.content }}{% if loop.last %}!{% endif %}<|im_end|>")
    delta = ChatContinuity(tok).continuation([{"role": "user", "content": "more"}], tok.eos_token_id)
    assert not delta.bridged and "more" in tok.decode(delta.token_ids)
