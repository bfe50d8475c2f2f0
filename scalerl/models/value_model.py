"""PPO's critic model: a decoder backbone with a scalar value head."""

from __future__ import annotations

import copy

import torch
from torch import nn

from scalerl.models.decoder import CausalLM


class ValueModel(nn.Module):
    """``V(s_t)`` per position: the backbone's final hidden state -> ``Linear(hidden, 1)``.

    Initialised from the policy (as verl/OpenRLHF do from the actor or a reward model) with a zero head,
    so the first values are 0 and the first advantages are plain discounted returns. Called like the
    policy (``input_ids, attention_mask, logits_to_keep``) and returns ``[B, logits_to_keep]`` values.
    """

    def __init__(self, policy: CausalLM):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        self.backbone.lm_head = None  # unused (hidden states are read before it); also unties embeddings
        self.value_head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(policy.parameters()).device)

    @property
    def config(self):
        return self.backbone.config

    @property
    def layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0
    ) -> torch.Tensor:
        hidden = self.backbone(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                               return_hidden=True)
        return self.value_head(hidden.float()).squeeze(-1)
