"""The rollout engine interface: prompts in, sampled token ids with their log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from scalerl.core.config import GREEDY_BELOW_TEMPERATURE
from scalerl.core.errors import UserError


class PromptTooLongError(UserError, ValueError):
    """A prompt plus the response length does not fit the model's positions; the message gives the numbers."""


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy, and a temperature below ``GREEDY_BELOW_TEMPERATURE``
    is made 0; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    seed: int | None = None
    # Rows of a larger batch split over ranks: this call's rows start at `row_offset` of `total_rows`.
    # Random draws are made for all `total_rows` from `seed` and sliced, so a sample depends only on its
    # global row, never on how the batch was split (distributed runs reproduce single-process ones).
    row_offset: int = 0
    total_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # `not >=` also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            # Decided here, once per request: logits / T would overflow float32 in every decode step (NaN
            # probabilities), and vLLM decodes such a temperature greedily too, so both engines agree.
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


@dataclass
class GenerationOutput:
    """A batch of completions, row ``i`` answering prompt ``i``.

    ``response_ids`` is right-padded with ``pad_token_id``; ``response_mask`` marks generated tokens (a stop
    token counts as generated). ``logprobs[i, t]`` is ``log softmax(logits / T)`` of the sampled token, T the
    sampling temperature (1 for greedy), i.e. the log-probability a full forward pass over
    ``prompt + response`` assigns, before top-k/top-p truncation. ``finish_reasons[i]`` is ``"stop"`` or
    ``"length"``. ``weight_versions[i, t]``, where known, is the policy version (optimizer steps) of the
    weights that generated token ``t`` (-1 on padding); a standalone worker sets it.

    A multi-turn rollout's response holds tokens that did not come from the engine (tool results, user turns,
    the chat template's glue between turns: `scalerl.rollout.trajectory`): ``loss_mask[i, t]`` is 1 where the
    engine sampled token ``t`` (it is trained), 0 where it came from elsewhere (it is context only; its
    ``logprobs`` are 0). ``response_mask`` still marks every real token. None: every response token is the
    engine's (a single turn, the one-segment case).
    """

    prompt_ids: torch.Tensor  # [B, P], left-padded
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]
    logprobs: torch.Tensor  # [B, R]
    finish_reasons: list[str]
    weight_versions: torch.Tensor | None = None  # [B, R] int32
    loss_mask: torch.Tensor | None = None  # [B, R]: 1 on the engine's tokens, 0 on tokens from elsewhere
    # per row, what the reward needs besides the text (a multi-turn episode's: the environment's own reward,
    # its info); None for single-turn rollouts
    reward_inputs: list[dict] | None = None
    # [B, P + R, num_sparse_layers, top_k] int32: the experts each token was routed to in each sparse MoE layer,
    # laid out as [prompt | response] (-1 where none was recorded: padding, the last response token); the
    # built-in engine records them when asked (`BuiltinEngine.record_routes`, actor.router_replay), else None
    routed_experts: torch.Tensor | None = None

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, R] float: the response tokens the update trains on (the engine's real tokens)."""
        mask = self.response_mask.float()
        return mask if self.loss_mask is None else mask * self.loss_mask.to(mask.dtype)

    def rows(self, start: int, stop: int) -> GenerationOutput:
        """Rows ``start:stop``, with columns that no kept row uses trimmed (prompts on the left, responses on
        the right), as if these rows had been generated alone."""
        prompt_mask, response_mask = self.prompt_mask[start:stop], self.response_mask[start:stop]
        left = int(prompt_mask.bool().any(0).int().argmax())
        used = response_mask.bool().any(0)
        width = int(used.nonzero().max()) + 1 if used.any() else 1
        return GenerationOutput(
            self.prompt_ids[start:stop, left:], prompt_mask[:, left:], self.response_ids[start:stop, :width],
            response_mask[:, :width], self.logprobs[start:stop, :width], self.finish_reasons[start:stop],
            None if self.weight_versions is None else self.weight_versions[start:stop, :width],
            None if self.loss_mask is None else self.loss_mask[start:stop, :width],
            None if self.reward_inputs is None else self.reward_inputs[start:stop],
            None if self.routed_experts is None
            else self.routed_experts[start:stop, left : self.prompt_ids.shape[1] + width],
        )

    @staticmethod
    def concat(parts: Sequence[GenerationOutput], pad_token_id: int) -> GenerationOutput:
        """Rows of several outputs in order: prompts left-padded, responses right-padded to common widths."""
        prompt_width = max(p.prompt_ids.shape[1] for p in parts)
        response_width = max(p.response_ids.shape[1] for p in parts)

        def pad(t: torch.Tensor, width: int, left: bool, value: float) -> torch.Tensor:
            extra = width - t.shape[1]
            return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

        return GenerationOutput(
            torch.cat([pad(p.prompt_ids, prompt_width, True, pad_token_id) for p in parts]),
            torch.cat([pad(p.prompt_mask, prompt_width, True, 0) for p in parts]),
            torch.cat([pad(p.response_ids, response_width, False, pad_token_id) for p in parts]),
            torch.cat([pad(p.response_mask, response_width, False, 0) for p in parts]),
            torch.cat([pad(p.logprobs, response_width, False, 0.0) for p in parts]),
            [r for p in parts for r in p.finish_reasons],
            torch.cat([pad(p.weight_versions, response_width, False, -1) for p in parts])
            if all(p.weight_versions is not None for p in parts) else None,
            # a part without a loss mask is all the engine's: its real tokens are trained
            torch.cat([pad(p.loss_mask if p.loss_mask is not None else p.response_mask, response_width, False, 0)
                       for p in parts]) if any(p.loss_mask is not None for p in parts) else None,
            [r for p in parts for r in (p.reward_inputs or [{}] * len(p.finish_reasons))]
            if any(p.reward_inputs is not None for p in parts) else None,
            torch.cat([torch.nn.functional.pad(p.routed_experts, (0, 0, 0, 0, prompt_width - p.prompt_ids.shape[1],
                                                                  response_width - p.response_ids.shape[1]), value=-1)
                       for p in parts]) if all(p.routed_experts is not None for p in parts) else None,
        )


class RolloutEngine(Protocol):
    # Whether its log-probs equal an fp32 training forward (the trainer then skips recomputing them).
    logprobs_match_training_forward: bool
    # Whether it generates with the trained parameters themselves (weight sync is then free); one that does
    # not also implements `scalerl.rollout.engines.weight_loading.WeightLoadingEngine` (see `scalerl.rollout.weight_sync`).
    shares_trainer_weights: bool

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """Generate one completion per prompt (repeat prompts for ``n`` samples each)."""
        ...


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``[B, P]`` ids and a 0/1 mask, so every prompt ends at the same column."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask
