"""The tensors of one RL step: prompts + responses laid out as ``[prompt (left-padded) | response (right-padded)]``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from scalerl.rollout.engines.engine import GenerationOutput, left_pad

# Fields laid out like the response, [B, R]; input_ids and attention_mask are [B, P + R].
PER_TOKEN_FIELDS = ("response_ids", "response_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs",
                    "teacher_logprobs", "teacher_topk", "values", "advantages", "returns", "is_weights")


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    response_ids: torch.Tensor  # [B, R]
    # [B, R] float, 1 on the tokens the update trains on: the engine's tokens (not a multi-turn trajectory's
    # tool results or user turns: `GenerationOutput.loss_mask`), minus stale or masked-out rows. The real
    # tokens, for positions and lengths, are `response_attention`.
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None  # [B, R] from the engine (None for demonstrations)
    group_ids: torch.Tensor  # [B] prompt index: the GRPO group
    scores: torch.Tensor  # [B] outcome reward per sequence
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # [B, R] on-policy distillation's teacher (algorithm.distill)
    # [B, R, 2k] the teacher's top-k ids (as floats) then their log-probs (algorithm.distill.top_k)
    teacher_topk: torch.Tensor | None = None
    distilled: torch.Tensor | None = None  # [B] bool: the rows with a teacher (algorithm.distill.teachers); None: all
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # [B, R] truncated importance weights (rollout vs old policy)
    # [B, P + R, num_sparse_layers, top_k] int: the engine's routed experts, laid out like input_ids (-1: none
    # recorded), replayed by the trainer's forwards with actor.router_replay (`scalerl.models.routing_replay`)
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_generation(cls, out: GenerationOutput, group_ids: torch.Tensor, scores: torch.Tensor) -> "RolloutBatch":
        return cls(
            input_ids=torch.cat([out.prompt_ids, out.response_ids], dim=1),
            attention_mask=torch.cat([out.prompt_mask, out.response_mask], dim=1),
            response_ids=out.response_ids,
            response_mask=out.trained_mask,
            rollout_logprobs=out.logprobs,
            group_ids=group_ids.to(out.response_ids.device),
            scores=scores.to(out.response_ids.device),
            routed_experts=out.routed_experts,
        )

    @classmethod
    def from_demonstrations(
        cls, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int
    ) -> "RolloutBatch":
        """SFT examples in the rollout layout: left-padded prompts, right-padded responses (the tokens the
        loss covers). Group ids and scores are unused there (zeros)."""
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
        width = max(len(r) for r in responses)
        response_ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(responses), width), dtype=torch.long)
        for i, r in enumerate(responses):
            response_ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            response_mask[i, : len(r)] = 1
        return cls(
            input_ids=torch.cat([prompt_ids, response_ids], dim=1),
            attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
            response_ids=response_ids,
            response_mask=response_mask.float(),
            rollout_logprobs=None,
            group_ids=torch.zeros(len(prompts), dtype=torch.long),
            scores=torch.zeros(len(prompts)),
        )

    def to(self, device: torch.device) -> "RolloutBatch":
        return replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in fields(self) if getattr(self, f.name) is not None
        })

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_ids.shape[1]

    @property
    def response_attention(self) -> torch.Tensor:
        """[B, R]: the response's real tokens (trained or not), from the attention mask: where a response
        ends and how long it is."""
        return self.attention_mask[:, self.prompt_len:]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] long: real tokens per response (a multi-turn one's tool results and user turns included)."""
        return self.response_attention.sum(-1).long()

    def token_rewards(self) -> torch.Tensor:
        """Outcome score placed on each sequence's last response token (zeros elsewhere)."""
        rewards = torch.zeros_like(self.response_mask)
        last = (self.response_lengths - 1).clamp(min=0)
        rewards.scatter_(1, last.unsqueeze(1), self.scores.unsqueeze(1).to(rewards.dtype))
        return rewards

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """Rows ``index`` of every tensor."""
        return replace(self, **{
            f.name: getattr(self, f.name)[index] for f in fields(self) if getattr(self, f.name) is not None
        })

    def padded_to(self, prompt_len: int, response_len: int) -> "RolloutBatch":
        """Left-pad prompts and right-pad responses to the given widths (ranks' tensors then stack, and
        pipeline stages, which fix activation shapes at their first step, see one shape every step)."""
        extra_p, extra_r = prompt_len - self.prompt_len, response_len - self.response_ids.shape[1]
        if extra_p < 0 or extra_r < 0:
            raise ValueError(f"cannot pad a batch of widths ({self.prompt_len}, {self.response_ids.shape[1]}) "
                             f"down to ({prompt_len}, {response_len})")
        updates = {
            "input_ids": F.pad(self.input_ids, (extra_p, extra_r)),
            "attention_mask": F.pad(self.attention_mask, (extra_p, extra_r)),
        }
        for name in PER_TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None:
                updates[name] = F.pad(t, (0, 0) * (t.dim() - 2) + (0, extra_r))  # [B, R, ...]: pad R
        if self.routed_experts is not None:  # laid out like input_ids; -1: no recorded route
            updates["routed_experts"] = F.pad(self.routed_experts, (0, 0, 0, 0, extra_p, extra_r), value=-1)
        return replace(self, **updates)

    def trimmed(self) -> tuple["RolloutBatch", int, int]:
        """Drop columns that are padding in every row (left of the prompts, right of the responses), which
        a micro-batch of short sequences spends most of its forward on. Returns the batch and the number of
        columns dropped on the left and on the right (callers pad per-token outputs back)."""
        valid = self.attention_mask.bool().any(0)
        first = int(valid.int().argmax())
        response_valid = self.response_attention.bool().any(0)
        keep_r = int(response_valid.nonzero().max()) + 1 if response_valid.any() else 1
        right = self.response_ids.shape[1] - keep_r
        left = min(first, self.prompt_len - 1)
        cols = slice(left, self.input_ids.shape[1] - right)
        updates = {"input_ids": self.input_ids[:, cols], "attention_mask": self.attention_mask[:, cols]}
        if self.routed_experts is not None:
            updates["routed_experts"] = self.routed_experts[:, cols]
        for name in PER_TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None:
                updates[name] = t[:, :keep_r]
        return replace(self, **updates), left, right
