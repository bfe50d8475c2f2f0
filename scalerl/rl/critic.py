"""PPO's critic: a decoder backbone with a scalar value head, and its clipped value-loss update."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from scalerl.models.decoder import CausalLM
from scalerl.rl.actor import micro_batches
from scalerl.rl.batch import RolloutBatch
from scalerl.rl.losses import value_loss


class ValueModel(nn.Module):
    """``V(s_t)`` for every response position: the backbone's final hidden state -> ``Linear(hidden, 1)``.

    Initialised from the policy (as verl/OpenRLHF do from the actor or a reward model) with a zero head,
    so the first values are 0 and the first advantages are plain discounted returns.
    """

    def __init__(self, policy: CausalLM):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        self.backbone.lm_head = nn.Identity()  # unused: the head below replaces it (and unties embeddings)
        self.value_head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(policy.parameters()).device)

    def forward(self, batch: RolloutBatch) -> torch.Tensor:
        response_len = batch.response_ids.shape[1]
        hidden = self.backbone(
            batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=response_len + 1, return_hidden=True
        )
        return self.value_head(hidden[:, :-1].float()).squeeze(-1)


@torch.no_grad()
def compute_values(critic: ValueModel, batch: RolloutBatch, micro_batch_size: int, autocast=None) -> torch.Tensor:
    out = []
    for micro in micro_batches(batch, micro_batch_size):
        micro, _, right = micro.trimmed()
        with autocast or contextlib.nullcontext():
            values = critic(micro) * micro.response_mask
        out.append(torch.nn.functional.pad(values, (0, right)) if right else values)
    return torch.cat(out)


def update_critic(
    critic: ValueModel,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    actor_cfg: Any,
    critic_cfg: Any,
    horizon: int,
    generator: torch.Generator,
    autocast=None,
) -> dict[str, float]:
    """Clipped value regression onto GAE returns, with the actor's epoch / mini / micro-batch layout."""
    losses, clipfracs, norms = [], [], []
    params = [p for p in critic.parameters() if p.requires_grad]
    critic.train()
    for _ in range(actor_cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator).to(batch.input_ids.device)
        for start in range(0, len(batch), actor_cfg.ppo_mini_batch_size):
            mini = batch.select(order[start : start + actor_cfg.ppo_mini_batch_size])
            agg = dict(
                global_num_tokens=mini.response_mask.sum(),
                global_num_seqs=(mini.response_mask.sum(-1) > 0).sum(),
                horizon=horizon,
            )
            optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            for micro in micro_batches(mini, actor_cfg.ppo_micro_batch_size):
                micro, _, _ = micro.trimmed()
                with autocast or contextlib.nullcontext():
                    vpreds = critic(micro)
                loss, metrics = value_loss(
                    vpreds, micro.returns, micro.values, micro.response_mask, critic_cfg.cliprange_value,
                    agg=actor_cfg.loss_agg_mode, **agg,
                )
                (critic_cfg.value_loss_coef * loss).backward()
                mini_loss = mini_loss + loss.detach()
                clipfracs.append(metrics["vf_clipfrac"])
            norms.append(torch.nn.utils.clip_grad_norm_(params, actor_cfg.grad_clip or float("inf")))
            optimizer.step()
            losses.append(mini_loss)
    return {
        "critic/vf_loss": float(torch.stack([torch.as_tensor(x) for x in losses]).mean()),
        "critic/vf_clipfrac": float(torch.stack(clipfracs).mean()),
        "critic/grad_norm": float(torch.stack(norms).mean()),
    }
