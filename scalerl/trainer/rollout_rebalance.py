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

from scalerl.parallel.distributed import DistContext
from scalerl.parallel.seqlen_balance import (
    balance_across_ranks,
    contiguous_partition,
    sequence_lengths,
    token_imbalance,
)
from scalerl.rollout.batch import RolloutBatch


def rebalance_batch(batch: RolloutBatch, ctx: DistContext, local_groups: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's rows after balancing, and ``balance/token_imbalance`` (max/mean tokens per rank) before
    and after. ``local_groups`` offsets group ids so they stay unique once rows change rank."""
    # Real tokens per row: the count the packed micro-batch budget (actor.micro_batch_max_tokens) sums.
    lengths = ctx.all_gather(sequence_lengths(batch.attention_mask), kind="rebalance").tolist()
    before = token_imbalance(lengths, contiguous_partition(lengths, ctx.dp_size, equal_size=True))
    partitions = balance_across_ranks(lengths, ctx.dp_size, equal_size=True)
    after = token_imbalance(lengths, partitions)
    widths = torch.tensor([batch.prompt_len, batch.response_ids.shape[1]], device=batch.input_ids.device)
    ctx.all_reduce(widths, op="max", kind="rebalance")
    padded = batch.padded_to(int(widths[0]), int(widths[1]))
    padded = replace(padded, group_ids=padded.group_ids + ctx.dp_rank * local_groups)
    mine = torch.tensor(partitions[ctx.dp_rank], device=batch.input_ids.device)
    gathered = {
        f.name: ctx.all_gather(getattr(padded, f.name), kind="rebalance")[mine]
        for f in fields(padded) if getattr(padded, f.name) is not None
    }
    return replace(padded, **gathered), {"balance/token_imbalance_before": before, "balance/token_imbalance": after}
