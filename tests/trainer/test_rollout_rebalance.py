"""Rollouts move between DP ranks so token counts even out, with every row's tensors intact."""

import torch

from scalerl.rollout.batch import RolloutBatch
from tests.spawned_group import run_in_group


def _skewed_batch(rank: int) -> RolloutBatch:
    # Rank 0 holds long responses, rank 1 short ones; each row's tensors encode (rank, row) to track it.
    rows, prompt, resp = 4, 3 + rank, 8 if rank == 0 else 3
    lengths = [8, 7, 8, 6] if rank == 0 else [1, 2, 3, 1]
    response_mask = torch.zeros(rows, resp)
    for i, n in enumerate(lengths):
        response_mask[i, :n] = 1
    tag = torch.tensor([rank * 10 + i for i in range(rows)], dtype=torch.float32)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    response_ids = (response_mask * tag.unsqueeze(1)).long()
    return RolloutBatch(
        input_ids=torch.cat([torch.full((rows, prompt), 5), response_ids], 1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], 1),
        response_ids=response_ids, response_mask=response_mask, rollout_logprobs=-response_mask,
        group_ids=torch.arange(rows) // 2, scores=tag, advantages=response_mask * tag.unsqueeze(1),
    )


def _rebalance(rank):
    from scalerl.core.config import ParallelSection
    from scalerl.parallel.distributed import init_distributed
    from scalerl.trainer.rollout_rebalance import rebalance_batch

    ctx = init_distributed(ParallelSection(dp_replicate=2), torch.device("cpu"))
    batch, metrics = rebalance_batch(_skewed_batch(rank), ctx, local_groups=2)
    return {
        "tags": batch.scores.tolist(), "tokens": int(batch.attention_mask.sum()), "metrics": metrics,
        "consistent": all(
            bool((batch.advantages[i] == batch.scores[i] * batch.response_mask[i]).all())
            and int(batch.response_mask[i].sum()) == int((batch.response_ids[i] == batch.scores[i]).sum() if batch.scores[i] else batch.response_mask[i].sum())
            for i in range(len(batch))
        ),
        "groups": batch.group_ids.tolist(),
    }


def test_rebalance_evens_tokens_and_keeps_rows_whole():
    results = run_in_group(_rebalance, 2)
    tags = sorted(results[0]["tags"] + results[1]["tags"])
    assert tags == [0, 1, 2, 3, 10, 11, 12, 13]  # every row once
    assert len(results[0]["tags"]) == len(results[1]["tags"]) == 4
    metrics = results[0]["metrics"]
    assert metrics == results[1]["metrics"]
    assert metrics["balance/token_imbalance"] < metrics["balance/token_imbalance_before"]
    assert abs(results[0]["tokens"] - results[1]["tokens"]) < 8
    assert results[0]["consistent"] and results[1]["consistent"]
    assert sorted(results[0]["groups"] + results[1]["groups"]) == [0, 0, 1, 1, 2, 2, 3, 3]
