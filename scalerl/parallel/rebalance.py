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
import torch.nn.functional as F

from scalerl.parallel.balance import balance_across_ranks, contiguous_partition, token_imbalance
from scalerl.parallel.distributed import DistContext
from scalerl.rl.batch import RolloutBatch

# Per-token fields laid out like the response ([B, R]); input_ids/attention_mask are [B, P + R].
_RESPONSE_FIELDS = ("response_ids", "response_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs",
                    "values", "advantages", "returns")


def _gather(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    out = torch.empty((ctx.dp_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=ctx.dp_group)
    return out


def _repad(batch: RolloutBatch, prompt_len: int, response_len: int) -> RolloutBatch:
    """Left-pad prompts and right-pad responses to the global widths so ranks' tensors stack."""
    extra_p, extra_r = prompt_len - batch.prompt_len, response_len - batch.response_ids.shape[1]
    updates = {
        "input_ids": F.pad(batch.input_ids, (extra_p, extra_r)),
        "attention_mask": F.pad(batch.attention_mask, (extra_p, extra_r)),
    }
    for name in _RESPONSE_FIELDS:
        t = getattr(batch, name)
        if t is not None:
            updates[name] = F.pad(t, (0, extra_r))
    return replace(batch, **updates)


def rebalance_batch(batch: RolloutBatch, ctx: DistContext, local_groups: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's rows after balancing, and ``balance/token_imbalance`` (max/mean tokens per rank) before
    and after. ``local_groups`` offsets group ids so they stay unique once rows change rank."""
    lengths = _gather(batch.attention_mask.sum(-1), ctx).tolist()
    before = token_imbalance(lengths, contiguous_partition(lengths, ctx.dp_size, equal_size=True))
    partitions = balance_across_ranks(lengths, ctx.dp_size, equal_size=True)
    after = token_imbalance(lengths, partitions)
    widths = torch.tensor([batch.prompt_len, batch.response_ids.shape[1]], device=batch.input_ids.device)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    padded = _repad(batch, int(widths[0]), int(widths[1]))
    padded = replace(padded, group_ids=padded.group_ids + ctx.dp_rank * local_groups)
    mine = torch.tensor(partitions[ctx.dp_rank], device=batch.input_ids.device)
    gathered = {
        f.name: _gather(getattr(padded, f.name), ctx)[mine]
        for f in fields(padded) if getattr(padded, f.name) is not None
    }
    return replace(padded, **gathered), {"balance/token_imbalance_before": before, "balance/token_imbalance": after}
