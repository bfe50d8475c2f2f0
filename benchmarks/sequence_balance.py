"""Sequence-length balancing on skewed RL batches: rank imbalance and micro-batch padding, side by side.

    python benchmarks/sequence_balance.py [--batches 20] [--batch-size 512] [--seed 0]

Response lengths are drawn from two skewed distributions: "mix" (80% short, 20-100 tokens; 20% long,
500-2000) and "lognormal" (median 150 tokens, sigma 1, clipped to 8-4096). For dp_size 2/4/8 it prints:

1. `token_imbalance` (max rank token sum / mean; 1.0 is perfect) of the naive contiguous split (slicing
   the batch in rank order), longest-first greedy, Karmarkar-Karp, and Karmarkar-Karp polished by
   `refine_by_swaps` (what `balance_across_ranks` does by default), all with equal sample counts per
   rank, and naive/(KK+swaps): roughly how much sooner the slowest rank finishes once balanced;
2. padding: each rank's KK shard run as fixed micro-batches of 8 rows in arrival order vs packed by
   `token_budget_micro_batches` under the budget a fixed micro-batch of 8 must already be provisioned for
   (8 x the longest possible response), so peak memory is the same. Waste = padded tokens that are not
   real tokens, as a share of all tokens the forward passes process.

Numbers are means over `--batches` seeded batches; pure Python, runs in a few seconds.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from scalerl.parallel.seqlen_balance import (
    balance_across_ranks,
    padded_token_count,
    token_budget_micro_batches,
    token_imbalance,
)

DP_SIZES = (2, 4, 8)
FIXED_MICRO_BATCH = 8


def mix_lengths(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(500, 2000) if rng.random() < 0.2 else rng.randint(20, 100) for _ in range(n)]


def lognormal_lengths(rng: random.Random, n: int) -> list[int]:
    return [min(4096, max(8, round(rng.lognormvariate(math.log(150), 1.0)))) for _ in range(n)]


DISTRIBUTIONS = {"mix": (mix_lengths, 2000), "lognormal": (lognormal_lengths, 4096)}  # (sampler, max length)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


# (column, method, refine_by_swaps afterwards)
BALANCERS = (
    ("naive", "contiguous", False),
    ("greedy", "greedy", False),
    ("KK", "karmarkar_karp", False),
    ("KK+swaps", "karmarkar_karp", True),
)


def rank_balance(batches: list[list[int]], dp_size: int) -> dict:
    result = {}
    for column, method, refine in BALANCERS:
        imbalances, seconds = [], []
        for lengths in batches:
            start = time.perf_counter()
            partitions = balance_across_ranks(lengths, dp_size, method=method, refine=refine)
            seconds.append(time.perf_counter() - start)
            imbalances.append(token_imbalance(lengths, partitions))
        result[column] = mean(imbalances)
        result[f"{column} ms"] = 1e3 * mean(seconds)
    return result


def micro_batch_padding(batches: list[list[int]], dp_size: int, max_len: int) -> dict:
    """Forward passes and padding waste over all ranks, fixed-size vs token-budget micro-batches."""
    budget = FIXED_MICRO_BATCH * max_len
    fixed_passes, fixed_padded, packed_passes, packed_padded, real = [], [], [], [], []
    for lengths in batches:
        counts = [0, 0, 0, 0]
        for shard in balance_across_ranks(lengths, dp_size):
            local = [lengths[i] for i in shard]
            rows = list(range(len(local)))
            fixed = [rows[s:s + FIXED_MICRO_BATCH] for s in range(0, len(rows), FIXED_MICRO_BATCH)]
            packed = token_budget_micro_batches(local, budget)
            counts[0] += len(fixed)
            counts[1] += padded_token_count(local, fixed)
            counts[2] += len(packed)
            counts[3] += padded_token_count(local, packed)
        for store, value in zip((fixed_passes, fixed_padded, packed_passes, packed_padded), counts):
            store.append(value)
        real.append(sum(lengths))
    return {
        "fixed_passes": mean(fixed_passes),
        "fixed_waste": 1 - mean(real) / mean(fixed_padded),
        "packed_passes": mean(packed_passes),
        "packed_waste": 1 - mean(real) / mean(packed_padded),
        "padded_ratio": mean(fixed_padded) / mean(packed_padded),
        "budget": budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20, help="seeded batches to average over")
    parser.add_argument("--batch-size", type=int, default=512, help="global batch (samples)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"global batch {args.batch_size}, mean of {args.batches} seeded batches, equal samples per rank\n")
    print("1) token imbalance across DP ranks (max rank tokens / mean; 1.0 = perfect)")
    print(f"{'lengths':<10} {'dp':>3} {'naive':>7} {'greedy':>7} {'KK':>7} {'KK+swaps':>9} {'naive/KK+swaps':>15} "
          f"{'KK+swaps ms':>12}")
    all_batches = {}
    for name, (sample, max_len) in DISTRIBUTIONS.items():
        rng = random.Random(args.seed)
        all_batches[name] = [sample(rng, args.batch_size) for _ in range(args.batches)]
        for dp_size in DP_SIZES:
            r = rank_balance(all_batches[name], dp_size)
            print(
                f"{name:<10} {dp_size:>3} {r['naive']:>7.3f} {r['greedy']:>7.4f} {r['KK']:>7.4f} {r['KK+swaps']:>9.4f} "
                f"{r['naive'] / r['KK+swaps']:>14.2f}x {r['KK+swaps ms']:>12.2f}"
            )

    print(f"\n2) micro-batch padding per step, all ranks (fixed: {FIXED_MICRO_BATCH} rows in arrival order; "
          f"budget: {FIXED_MICRO_BATCH} x max length, same peak memory)")
    print(f"{'lengths':<10} {'dp':>3} {'budget':>7} {'fixed passes':>13} {'fixed waste':>12} "
          f"{'budget passes':>14} {'budget waste':>13} {'padded fixed/budget':>20}")
    for name, (_, max_len) in DISTRIBUTIONS.items():
        for dp_size in DP_SIZES:
            r = micro_batch_padding(all_batches[name], dp_size, max_len)
            print(
                f"{name:<10} {dp_size:>3} {r['budget']:>7} {r['fixed_passes']:>13.1f} {r['fixed_waste']:>11.1%} "
                f"{r['packed_passes']:>14.1f} {r['packed_waste']:>12.1%} {r['padded_ratio']:>19.2f}x"
            )


if __name__ == "__main__":
    main()
