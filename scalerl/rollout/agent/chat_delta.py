"""Token continuity across turns: each new turn's prompt is the previous prompt + the tokens the engine
sampled + the tokens of the new messages only, so the ids trained are exactly the ids generated.

Re-rendering the whole conversation through the chat template after every turn is what breaks trajectories in
practice: a template that strips ``<think>`` blocks from earlier turns, groups consecutive tool messages, or
tokenizes a turn's text differently from the ids the engine sampled gives training tokens the engine never
produced. Here the conversation is rendered once (`ChatContinuity.prompt`) and every later turn adds a
*delta*: the template's rendering of a fixed stand-in conversation, with and without the new messages, and
the text between the two is the new messages' part (with the next assistant turn's generation prompt).
Before it goes the template's glue after an assistant turn's end-of-turn token, which the engine stops at
and does not generate (Qwen's ``\\n`` after ``<|im_end|>``); a turn cut by the length limit gets the
end-of-turn token too. Where the template renders the stand-in differently once messages follow (it
rewrites earlier turns), the delta is the text past the longest common prefix, and the break is counted
(``agent/prefix_breaks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A conversation the delta is measured against: the template renders it the same whatever follows, for
# every template tried (Qwen2.5, Qwen3, Llama 3); its assistant turn has no reasoning block to strip.
STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


@dataclass
class Continuation:
    """The tokens that follow a finished engine turn: the template's glue, the new messages, the next
    assistant turn's generation prompt; ``bridged`` False where the template rewrote the stand-in."""

    token_ids: list[int]
    bridged: bool = True


class ChatContinuity:
    """Renders one conversation's messages into tokens turn by turn through ``tokenizer``'s chat template
    (scalerl's `HFTokenizer`: ``apply_chat_template(messages, add_generation_prompt, **kwargs) -> str``,
    ``encode``, ``token_string``), with ``tools`` (JSON schemas) passed to the template where given."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, **template_kwargs: Any):
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs)
        if tools:
            self.template_kwargs["tools"] = tools
        self.end_of_turn = [tokenizer.token_string(i) for i in tokenizer.stop_token_ids]
        self._before = self._render(STAND_IN, add_generation_prompt=False)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first turn's prompt: ``messages`` rendered whole, with the generation prompt."""
        return self.tokenizer.encode(self._render(messages, add_generation_prompt=True))

    def continuation(self, new_messages: list[dict], ended_with: int | None) -> Continuation:
        """The tokens after an engine turn whose last sampled token is ``ended_with`` (None: an empty turn) for
        ``new_messages`` (tool results, a user turn), ending with the next turn's generation prompt."""
        after = self._render(STAND_IN + list(new_messages), add_generation_prompt=True)
        before, bridged = self._before, after.startswith(self._before)
        if not bridged:  # the template rewrote the stand-in: keep what differs, counted
            common = 0
            for a, b in zip(before, after):
                if a != b:
                    break
                common += 1
            before = before[:common]
        glue = self._glue(ended_with) if bridged else ""
        return Continuation(self.tokenizer.encode(glue + after[len(before):]), bridged)

    def _glue(self, ended_with: int | None) -> str:
        """What the template puts after the assistant's content that the engine did not sample: after its
        end-of-turn token where the turn stopped there, else that token too (a turn cut by the length limit)."""
        token = self.tokenizer.token_string(ended_with) if ended_with is not None else None
        if token in self.end_of_turn and token and token in self._before:
            return self._before[self._before.rindex(token) + len(token):]
        for eot in self.end_of_turn:  # the turn did not end with one: the template's end of the turn, whole
            if eot and eot in self._before:
                cut = self._before.rindex(eot)
                return self._before[cut:]
        return ""
