"""Moving rollouts between data-parallel ranks so each rank updates on a near-equal number of tokens.

Ranks generate for their own prompts, so one rank may end up with most of the long responses and make the
others wait at every gradient reduction. After advantages are computed (GRPO groups never straddle ranks),
every rank gathers the global lengths, computes the same Karmarkar-Karp assignment, all-gathers the batch
and keeps its new rows. All-gather moves dp x the batch; an all-to-all would move only what changes owner,
which matters for large batches and is the next step here.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.distributed as dist

from scalerl.parallel.distributed import DistContext
from scalerl.parallel.seqlen_balance import (
    balance_across_ranks,
    contiguous_partition,
    token_imbalance,
)
from scalerl.rollout.batch import RolloutBatch


def _gather(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    out = torch.empty((ctx.dp_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    with ctx.comm.collective("rebalance", "all_gather", out, ctx.dp_group, dim="dp"):
        dist.all_gather_into_tensor(out, t.contiguous(), group=ctx.dp_group)
    return out


def rebalance_batch(batch: RolloutBatch, ctx: DistContext, local_groups: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's rows after balancing, and ``balance/token_imbalance`` (max/mean tokens per rank) before
    and after. ``local_groups`` offsets group ids so they stay unique once rows change rank."""
    lengths = _gather(batch.attention_mask.sum(-1), ctx).tolist()
    before = token_imbalance(lengths, contiguous_partition(lengths, ctx.dp_size, equal_size=True))
    partitions = balance_across_ranks(lengths, ctx.dp_size, equal_size=True)
    after = token_imbalance(lengths, partitions)
    widths = torch.tensor([batch.prompt_len, batch.response_ids.shape[1]], device=batch.input_ids.device)
    with ctx.comm.collective("rebalance", "all_reduce", widths, ctx.dp_group, dim="dp"):
        dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    padded = batch.padded_to(int(widths[0]), int(widths[1]))
    padded = replace(padded, group_ids=padded.group_ids + ctx.dp_rank * local_groups)
    mine = torch.tensor(partitions[ctx.dp_rank], device=batch.input_ids.device)
    gathered = {
        f.name: _gather(getattr(padded, f.name), ctx)[mine]
        for f in fields(padded) if getattr(padded, f.name) is not None
    }
    return replace(padded, **gathered), {"balance/token_imbalance_before": before, "balance/token_imbalance": after}
