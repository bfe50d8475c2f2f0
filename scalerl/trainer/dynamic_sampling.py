"""DAPO's dynamic sampling (``algorithm.filter_groups``): generation rounds until the step's batch is full
of prompt groups whose metric varies.

A group whose samples all score the same has every GRPO advantage 0: it costs an update and teaches
nothing, and under token-mean aggregation it dilutes the groups that do teach. `fill_with_signal` drops
such groups (`scalerl.algorithms.dapo.groups_with_signal`) and asks the trainer for further rounds (more
prompts drawn from the stream, generated and scored) until every data-parallel rank holds its share of
``trainer.batch_size`` groups, or ``max_num_gen_batches`` rounds were made; then the step trains on what
was kept (``filter/batch_full`` = 0), like verl's trainer on a smaller batch.

The decision is global: each round the DP ranks all-gather their per-group keep flags, so every rank
counts the same kept groups per rank and stops after the same round. Each rank keeps its own groups (no
rollouts move): the step trains on the fewest any rank kept, up to its share, so every rank holds the
same number of rows and runs the same mini-batches. When no rank kept a group at the limit, the step
trains on the first round unfiltered (there is no signal to keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from scalerl.algorithms.dapo import groups_with_signal
from scalerl.parallel.distributed import DistContext
from scalerl.rollout.engines.engine import GenerationOutput


@dataclass
class GeneratedRound:
    """One round's rollouts on this DP rank: its share of the drawn rows, ``n`` samples of each (row-major)
    and their scores; ``failures`` counts the samples whose reward failed."""

    rows: list[dict]
    out: GenerationOutput
    scores: list[float]
    failures: int


def fill_with_signal(first: GeneratedRound, next_round: Callable[[int], GeneratedRound], ctx: DistContext, *,
                     n: int, groups_per_rank: int, max_rounds: int, pad_token_id: int,
                     groups_multiple: int = 1) -> tuple[GeneratedRound, dict[str, float]]:
    """This rank's groups with signal from ``first`` and as many further rounds as needed
    (``next_round(k)`` generates round ``k``, counting from 0 = ``first``); ``max_rounds`` 0 = no limit.
    A short batch keeps a multiple of ``groups_multiple`` groups (a pipeline's schedule takes whole
    mini-batches only). Returns the kept rows as one round (``failures`` summed over every round)
    and the ``filter/*`` metrics, the same on every rank."""
    kept_by_round: list[tuple[GeneratedRound, list[int]]] = []  # each round with this rank's kept groups
    kept_per_rank = torch.zeros(ctx.dp_size, dtype=torch.int64)
    kept = dropped = failures = 0
    current, rounds = first, 1
    while True:
        num_groups = len(current.rows)
        keep, _, _ = groups_with_signal(torch.tensor(current.scores, dtype=torch.float64),
                                        torch.arange(num_groups).repeat_interleave(n))
        mine = keep.view(num_groups, n)[:, 0]
        flags = ctx.all_gather(mine.to(device=ctx.device, dtype=torch.int64), kind="metrics").cpu()
        flags = flags.view(ctx.dp_size, num_groups)
        kept_per_rank += flags.sum(1)
        kept, dropped = kept + int(flags.sum()), dropped + int((flags == 0).sum())
        failures += current.failures
        kept_by_round.append((current, mine.nonzero().flatten().tolist()))
        if int(kept_per_rank.min()) >= groups_per_rank or (max_rounds and rounds >= max_rounds):
            break
        current, rounds = next_round(rounds), rounds + 1
    take = min(int(kept_per_rank.min()), groups_per_rank)
    if take < groups_per_rank:
        take -= take % groups_multiple
    metrics = {"filter/kept_groups": float(kept), "filter/dropped_groups": float(dropped),
               "filter/gen_batches": float(rounds), "filter/trained_groups": float(max(take, 0) * ctx.dp_size),
               "filter/batch_full": float(take == groups_per_rank)}
    if take == 0:  # nothing varies anywhere: train as unfiltered
        metrics["filter/trained_groups"] = float(len(first.rows) * ctx.dp_size)
        return GeneratedRound(first.rows, first.out, first.scores, failures), metrics
    rows, outs, scores = [], [], []
    for generated, groups in kept_by_round:
        for g in groups[: take - len(rows)]:
            rows.append(generated.rows[g])
            outs.append(generated.out.rows(g * n, (g + 1) * n))
            scores.extend(generated.scores[g * n : (g + 1) * n])
    return GeneratedRound(rows, GenerationOutput.concat(outs, pad_token_id), scores, failures), metrics
