"""PPO's critic: a decoder backbone with a scalar value head, and its clipped value-loss update."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from scalerl.models.decoder import CausalLM
from scalerl.parallel.data_parallel import apply_ddp
from scalerl.parallel.distributed import DistContext, single_process_context
from scalerl.parallel.grad_norm import clip_grad_norm, trainable_parameters
from scalerl.parallel.mesh import LayoutError
from scalerl.parallel.tensor_parallel import apply_tensor_parallel
from scalerl.rl.actor import aggregation_counts, micro_batches
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
        self.backbone.lm_head = None  # unused (hidden states are read before it); also unties embeddings
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


def parallelize_critic(critic: ValueModel, ctx: DistContext) -> nn.Module:
    """The critic laid out like the policy: DDP for plain replication; otherwise TP on the backbone and
    FSDP2 per backbone layer plus a root unit holding embeddings, norm and the value head."""
    dims = ctx.dims
    if ctx.world_size == 1:
        return critic
    if dims.pp > 1:
        raise LayoutError("algorithm.adv_estimator=gae (a critic) does not run with parallel.pp > 1 yet")
    if dims.tp > 1:
        apply_tensor_parallel(critic.backbone, ctx.mesh["tp"])
    if dims.dp > 1:
        if dims.dp_shard == 1 and dims.tp == 1:
            return apply_ddp(critic, ctx.dp_mesh)
        mesh = ctx.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else ctx.mesh["dp_shard"]
        for layer in critic.backbone.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(critic, mesh=mesh)
    return critic


def update_critic(
    critic: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    actor_cfg: Any,
    critic_cfg: Any,
    horizon: int,
    generator: torch.Generator,
    autocast=None,
    dist_ctx: DistContext | None = None,
) -> dict[str, float]:
    """Clipped value regression onto GAE returns, with the actor's epoch / mini / micro-batch layout and
    its global token counts (so DP ranks and micro-batches reproduce the full-batch gradient)."""
    ctx = dist_ctx or single_process_context()
    losses, clipfracs, norms = [], [], []
    mini_size = actor_cfg.ppo_mini_batch_size // ctx.dp_size
    critic.train()
    for _ in range(actor_cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator).to(batch.input_ids.device)
        for start in range(0, len(batch), mini_size):
            mini = batch.select(order[start : start + mini_size])
            agg = aggregation_counts(mini, ctx, horizon)
            optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            micros = list(micro_batches(mini, actor_cfg.ppo_micro_batch_size))
            for i, micro in enumerate(micros):
                micro, _, _ = micro.trimmed()
                with autocast or contextlib.nullcontext():
                    vpreds = critic(micro)
                loss, metrics = value_loss(
                    vpreds, micro.returns, micro.values, micro.response_mask, critic_cfg.cliprange_value,
                    agg=actor_cfg.loss_agg_mode, **agg,
                )
                no_sync = getattr(critic, "no_sync", None) if i < len(micros) - 1 else None
                with no_sync() if no_sync else contextlib.nullcontext():
                    (critic_cfg.value_loss_coef * loss).backward()
                mini_loss = mini_loss + loss.detach()
                clipfracs.append(metrics["vf_clipfrac"])
            norms.append(clip_grad_norm(trainable_parameters(critic), actor_cfg.grad_clip))
            optimizer.step()
            losses.append(mini_loss)
    return {
        "critic/vf_loss": float(torch.stack([torch.as_tensor(x) for x in losses]).mean()),
        "critic/vf_clipfrac": float(torch.stack(clipfracs).mean()),
        "critic/grad_norm": float(torch.stack(norms).mean()),
    }
