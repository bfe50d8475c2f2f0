"""The tensors of one RL step: prompts + responses laid out as ``[prompt (left-padded) | response (right-padded)]``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from scalerl.rollout.engine import GenerationOutput


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] float, 1 on generated tokens
    rollout_logprobs: torch.Tensor  # [B, R] from the engine
    group_ids: torch.Tensor  # [B] prompt index: the GRPO group
    scores: torch.Tensor  # [B] outcome reward per sequence
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @classmethod
    def from_generation(cls, out: GenerationOutput, group_ids: torch.Tensor, scores: torch.Tensor) -> "RolloutBatch":
        return cls(
            input_ids=torch.cat([out.prompt_ids, out.response_ids], dim=1),
            attention_mask=torch.cat([out.prompt_mask, out.response_mask], dim=1),
            response_ids=out.response_ids,
            response_mask=out.response_mask.float(),
            rollout_logprobs=out.logprobs,
            group_ids=group_ids.to(out.response_ids.device),
            scores=scores.to(out.response_ids.device),
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_ids.shape[1]

    def token_rewards(self) -> torch.Tensor:
        """Outcome score placed on each sequence's last response token (zeros elsewhere)."""
        rewards = torch.zeros_like(self.response_mask)
        last = (self.response_mask.sum(-1).long() - 1).clamp(min=0)
        rewards.scatter_(1, last.unsqueeze(1), self.scores.unsqueeze(1).to(rewards.dtype))
        return rewards

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """Rows ``index`` of every tensor."""
        return replace(self, **{
            f.name: getattr(self, f.name)[index] for f in fields(self) if getattr(self, f.name) is not None
        })

    def trimmed(self) -> tuple["RolloutBatch", int, int]:
        """Drop columns that are padding in every row (left of the prompts, right of the responses), which
        a micro-batch of short sequences spends most of its forward on. Returns the batch and the number of
        columns dropped on the left and on the right (callers pad per-token outputs back)."""
        valid = self.attention_mask.bool().any(0)
        first = int(valid.int().argmax())
        response_valid = self.response_mask.bool().any(0)
        keep_r = int(response_valid.nonzero().max()) + 1 if response_valid.any() else 1
        right = self.response_ids.shape[1] - keep_r
        left = min(first, self.prompt_len - 1)
        cols = slice(left, self.input_ids.shape[1] - right)
        per_token = {"response_ids", "response_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs",
                     "values", "advantages", "returns"}
        updates = {"input_ids": self.input_ids[:, cols], "attention_mask": self.attention_mask[:, cols]}
        for name in per_token:
            t = getattr(self, name)
            if t is not None:
                updates[name] = t[:, :keep_r]
        return replace(self, **updates), left, right
