"""A rollout as the trainer trains it: a *trajectory*, the prompt's tokens and then segments, each either sampled
by the engine (trained, with its log-probs and the policy version that sampled it) or come from elsewhere (a
tool's result, a user turn, the chat template's glue between turns: context only, never trained). A
single-turn response is the one-segment case.

`trajectories_to_output` lays trajectories out as the `GenerationOutput` every rollout source hands the
trainer (left-padded prompts, right-padded responses), with ``loss_mask`` 1 on the engine's tokens (but those a
segment's own ``loss_mask`` keeps out: sampled, kept with their log-probs, not trained): the
trainer's passes run over every real token, and its losses, KL, entropy and metrics read only the trained
ones (`RolloutBatch.response_mask`). The token ids are the ones the engine sampled and the environment
gave, as they are: a multi-turn producer builds each turn's prompt as the last prompt + its completion + the
new messages' tokens and never re-renders the conversation, so the ids trained are the ids generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from scalerl.rollout.engines.engine import GenerationOutput


@dataclass
class TrajectorySegment:
    """Consecutive response tokens of one origin: ``generated`` by the engine (with ``logprobs``, one per
    token, and the ``weight_version`` that sampled them) or not (tool result, user turn, template glue)."""

    token_ids: list[int]
    generated: bool
    logprobs: list[float] | None = None
    weight_version: int = -1
    # Per token, only where a weight push landed while the segment decoded (a partial rollout on a streaming
    # worker): the version of each token; ``weight_version`` is then the last token's.
    weight_versions: list[int] | None = None
    # Per token of a generated segment, only where some sampled tokens are kept out of the loss (a verl agent loop
    # that masks part of a turn 0): 1 trained, 0 context (its ids and log-probs stay in the trajectory).
    loss_mask: list[int] | None = None

    def __post_init__(self) -> None:
        if self.generated and (self.logprobs is None or len(self.logprobs) != len(self.token_ids)):
            have = "none" if self.logprobs is None else len(self.logprobs)
            raise ValueError(f"a generated segment of {len(self.token_ids)} tokens needs as many log-probs "
                             f"(got {have})")
        if self.weight_versions is not None and len(self.weight_versions) != len(self.token_ids):
            raise ValueError(f"a segment of {len(self.token_ids)} tokens has {len(self.weight_versions)} per-token "
                             "weight versions; give one per token, or none")
        if self.loss_mask is not None and (not self.generated or len(self.loss_mask) != len(self.token_ids)):
            raise ValueError(f"a loss mask of {len(self.loss_mask)} values on a {'' if self.generated else 'non-'}"
                             f"generated segment of {len(self.token_ids)} tokens; give one per sampled token")


@dataclass
class Trajectory:
    """One rollout: ``prompt_ids``, then its response as ``segments`` in order; ``finish_reason`` ("stop",
    "length") of its last engine turn; ``reward_inputs``: what the reward needs besides the text (the data
    row, the environment's reward where it gave one, its info)."""

    prompt_ids: list[int]
    segments: list[TrajectorySegment]
    finish_reason: str = "stop"
    reward_inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def num_turns(self) -> int:
        """Engine turns: the generated segments."""
        return sum(s.generated for s in self.segments)


def trajectories_to_output(trajectories: Sequence[Trajectory], pad_token_id: int,
                           response_width: int | None = None) -> GenerationOutput:
    """The trajectories as one `GenerationOutput`, row ``i`` the ``i``-th: prompts left-padded, responses
    right-padded (to ``response_width`` where given, at least the longest), the engine's log-probs in place
    (0 elsewhere), ``loss_mask`` 1 on generated tokens, ``weight_versions`` where any segment knows its
    version (-1 on tokens from elsewhere and padding)."""
    if not trajectories:
        raise ValueError("no trajectories to lay out")
    rows = len(trajectories)
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    longest = max(len(t.response_ids) for t in trajectories)
    width = max(longest, 1) if response_width is None else response_width
    if width < longest:
        raise ValueError(f"a trajectory's response has {longest} tokens, more than the width {width}")
    prompt_ids = torch.full((rows, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    response_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width, dtype=torch.long)
    logprobs = torch.zeros(rows, width)
    versions = torch.full((rows, width), -1, dtype=torch.int32)
    for i, t in enumerate(trajectories):
        if t.prompt_ids:
            prompt_ids[i, prompt_width - len(t.prompt_ids):] = torch.tensor(t.prompt_ids)
            prompt_mask[i, prompt_width - len(t.prompt_ids):] = 1
        at = 0
        for s in t.segments:
            stop = at + len(s.token_ids)
            response_ids[i, at:stop] = torch.tensor(s.token_ids, dtype=torch.long)
            response_mask[i, at:stop] = 1
            if s.generated:
                loss_mask[i, at:stop] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.long)
                logprobs[i, at:stop] = torch.tensor(s.logprobs, dtype=torch.float32)
                versions[i, at:stop] = (s.weight_version if s.weight_versions is None
                                        else torch.tensor(s.weight_versions, dtype=torch.int32))
            at = stop
    known = any(s.weight_version >= 0 for t in trajectories for s in t.segments if s.generated)
    return GenerationOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                            [t.finish_reason for t in trajectories], versions if known else None, loss_mask,
                            [t.reward_inputs for t in trajectories])
