"""Sequence-length balancing: which samples go to which data-parallel rank, and into which micro-batch.

RL batches are skewed: most responses are short, a few run to the length limit. Slicing the global batch
in rank order leaves one rank with several long responses while the others wait for it at the gradient
all-reduce, so the step runs at the speed of the slowest rank. Two fixes live here:

* across ranks, `balance_across_ranks` partitions the global batch so every rank gets a near-equal token
  sum (Karmarkar-Karp's largest-differencing method, or longest-processing-time-first greedy, then a few
  swaps between the heaviest and a lighter rank);
* within a rank, `token_budget_micro_batches` packs samples into micro-batches bounded by a token budget
  instead of a fixed row count ("dynamic batch size"), so short rows share a forward pass and long ones
  do not blow the memory.

Everything is a pure, deterministic function of the lengths (ties broken by sample index), so every rank
computes the same assignment on its own and no communication is needed to agree on it.
`token_imbalance` is the metric the trainer reports as `balance/token_imbalance`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Callable, Iterable, Sequence


def _as_lengths(seqlens: Iterable[int]) -> list[int]:
    """Plain ints (accepts lists, numpy arrays, 1-D tensors); rejects negative lengths."""
    lengths = [int(x) for x in seqlens]
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sequence lengths must be >= 0, got seqlens[{i}] = {length}")
    return lengths


def _check_partition_args(num_items: int, k_partitions: int, equal_size: bool) -> None:
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    if equal_size and num_items % k_partitions != 0:
        raise ValueError(
            f"equal_size=True needs the number of items ({num_items}) to be divisible by "
            f"k_partitions ({k_partitions})"
        )


def karmarkar_karp(seqlens: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Partition sample indices into `k_partitions` groups with near-equal token sums.

    The largest-differencing method (Karmarkar & Karp 1982, generalised to k sets): every item starts as a
    k-tuple of sets (the item in one, the others empty); repeatedly take the two tuples whose
    largest-minus-smallest sum (spread) is biggest and merge them, pairing the largest set of one with
    the smallest of the other, which cancels most of both spreads. The last tuple left is the partition.

    With `equal_size=True` the items, sorted by length, are cut into consecutive chunks of k and each chunk
    starts as one tuple with one item per set; every merge then adds exactly one item of each chunk to
    each set, so all partitions end with len(seqlens) / k items.

    Returns k lists of indices, each sorted ascending; a partition may be empty only when
    `equal_size=False` and there are fewer items than partitions.
    """
    lengths = _as_lengths(seqlens)
    _check_partition_args(len(lengths), k_partitions, equal_size)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))

    # A tuple is a list of k [sum, indices] sets kept in descending order of sum. The heap pops the tuple
    # with the largest spread first; ties go to the larger top set, then to creation order (uid), so the
    # result is a deterministic function of the input.
    heap: list = []
    uid = itertools.count()

    def push(sets: list[list]) -> None:
        sets.sort(key=lambda s: -s[0])  # stable: equal sums keep their previous order
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), -sets[0][0], next(uid), sets))

    if equal_size:
        for start in range(0, len(order), k_partitions):
            push([[lengths[i], [i]] for i in order[start:start + k_partitions]])
    else:
        for i in order:
            push([[lengths[i], [i]]] + [[0, []] for _ in range(k_partitions - 1)])

    while len(heap) > 1:
        first = heapq.heappop(heap)[3]
        second = heapq.heappop(heap)[3]
        merged = []
        for big, small in zip(first, reversed(second)):
            # Extend the longer index list with the shorter so merging costs O(n log n) overall.
            items_a, items_b = (big[1], small[1]) if len(big[1]) >= len(small[1]) else (small[1], big[1])
            items_a.extend(items_b)
            merged.append([big[0] + small[0], items_a])
        push(merged)

    if not heap:
        return [[] for _ in range(k_partitions)]
    return [sorted(indices) for _, indices in heap[0][3]]


def greedy_partition(seqlens: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Longest-processing-time-first: hand samples out longest first, each to the partition with the
    smallest token sum so far (ties to the lower partition). With `equal_size=True` a partition stops
    taking samples once it holds len(seqlens) / k. Simpler than Karmarkar-Karp and usually a little worse
    (LPT's max sum is within 4/3 of optimal). Returns k lists of indices, each sorted ascending."""
    lengths = _as_lengths(seqlens)
    _check_partition_args(len(lengths), k_partitions, equal_size)
    capacity = len(lengths) // k_partitions if equal_size else len(lengths)
    partitions: list[list[int]] = [[] for _ in range(k_partitions)]
    open_partitions = [(0, p) for p in range(k_partitions)]  # (token sum, partition id): a min-heap
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, p = heapq.heappop(open_partitions)
        partitions[p].append(i)
        if len(partitions[p]) < capacity:
            heapq.heappush(open_partitions, (total + lengths[i], p))
    return [sorted(partition) for partition in partitions]


def contiguous_partition(seqlens: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """The unbalanced baseline: slice the batch in order, as a plain DistributedSampler shard does.
    Partition sizes differ by at most one (exactly equal with `equal_size=True`)."""
    lengths = _as_lengths(seqlens)
    _check_partition_args(len(lengths), k_partitions, equal_size)
    base, extra = divmod(len(lengths), k_partitions)
    partitions, start = [], 0
    for p in range(k_partitions):
        size = base + (1 if p < extra else 0)
        partitions.append(list(range(start, start + size)))
        start += size
    return partitions


def refine_by_swaps(
    seqlens: Sequence[int], partitions: Sequence[Sequence[int]], equal_size: bool, max_rounds: int | None = None
) -> list[list[int]]:
    """Local search after a partitioner: swap one sample of the heaviest partition with a shorter one of a
    lighter partition (or, with `equal_size=False`, move it) whenever that narrows their gap.

    Why: equal-size Karmarkar-Karp gives every partition one item of each chunk of k consecutive lengths,
    so when one response is far longer than the rest (a heavy tail), the short chunks' small spreads
    cannot make up for it and the heaviest rank can stay several % over the mean. A few swaps fix that.
    Each swap moves delta tokens with 0 < delta < gap, choosing delta closest to gap / 2, which strictly
    lowers the sum of squared partition sums, so the search ends; the max sum never grows and partition
    sizes never change under `equal_size=True`. Returns new lists (indices ascending).
    """
    lengths = _as_lengths(seqlens)
    parts = [sorted(p, key=lambda i: (lengths[i], i)) for p in partitions]
    sums = [sum(lengths[i] for i in p) for p in parts]
    for _ in range(max_rounds if max_rounds is not None else 4 * len(lengths) + 1):
        heavy = max(range(len(parts)), key=lambda p: (sums[p], -p))
        for light in sorted(range(len(parts)), key=lambda p: (sums[p], p)):
            swap = _best_swap(lengths, parts[heavy], parts[light], sums[heavy] - sums[light], not equal_size)
            if swap is not None:
                break
        else:
            break  # no partition can take load from the heaviest one
        out, back = swap
        parts[heavy].remove(out)
        parts[light].append(out)
        sums[heavy] -= lengths[out]
        sums[light] += lengths[out]
        if back is not None:
            parts[light].remove(back)
            parts[heavy].append(back)
            sums[heavy] += lengths[back]
            sums[light] -= lengths[back]
        for p in (heavy, light):
            parts[p].sort(key=lambda i: (lengths[i], i))
    return [sorted(p) for p in parts]


def _best_swap(
    lengths: list[int], heavy: list[int], light: list[int], gap: int, allow_move: bool
) -> tuple[int, int | None] | None:
    """(sample leaving `heavy`, sample leaving `light` or None for a plain move) whose net transfer delta
    satisfies 0 < delta < gap and is closest to gap / 2; None if there is none. Both lists are sorted by
    (length, index); ties go to the smaller indices so the result is deterministic."""
    light_lengths = [lengths[i] for i in light]
    best, best_key = None, None
    for out in heavy:
        candidates = [None] if allow_move else []
        # The ideal partner has length lengths[out] - gap / 2: look at its neighbours in the sorted list.
        position = bisect.bisect_left(light_lengths, lengths[out] - gap / 2)
        candidates += [light[j] for j in (position - 1, position) if 0 <= j < len(light)]
        for back in candidates:
            delta = lengths[out] - (lengths[back] if back is not None else 0)
            if 0 < delta < gap:
                key = (abs(gap - 2 * delta), out, -1 if back is None else back)
                if best_key is None or key < best_key:
                    best, best_key = (out, back), key
    return best


PARTITION_METHODS: dict[str, Callable[[Sequence[int], int, bool], list[list[int]]]] = {
    "karmarkar_karp": karmarkar_karp,
    "greedy": greedy_partition,
    "contiguous": contiguous_partition,
}


def balance_across_ranks(
    seqlens: Sequence[int],
    dp_size: int,
    equal_size: bool = True,
    method: str = "karmarkar_karp",
    refine: bool = True,
) -> list[list[int]]:
    """Global sample indices for each data-parallel rank: entry r lists rank r's samples, ascending.

    `seqlens` holds the token count (prompt + response) of every sample in the global batch, in the same
    order on every rank; the answer is deterministic, so each rank computes it independently and keeps
    `result[rank]`. `equal_size=True` gives every rank the same number of samples (needed when each rank
    runs a fixed number of fixed-size micro-batches). Ranks are ordered by their smallest sample index,
    so the assignment does not depend on the partitioner's internal order.
    `method`: "karmarkar_karp" (default), "greedy", or "contiguous" (no balancing, the baseline).
    `refine`: polish the partition with `refine_by_swaps` (never for "contiguous"; milliseconds for a
    batch of thousands, and it removes equal-size KK's heavy-tail weakness).
    """
    if method not in PARTITION_METHODS:
        raise ValueError(f"unknown balancing method {method!r}; choose from {sorted(PARTITION_METHODS)}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    lengths = _as_lengths(seqlens)
    if len(lengths) < dp_size:
        # An empty rank would skip forward/backward and hang its peers in the gradient all-reduce.
        raise ValueError(f"need at least one sample per rank: {len(lengths)} samples for dp_size={dp_size}")
    partitions = PARTITION_METHODS[method](lengths, dp_size, equal_size)
    if refine and method != "contiguous":
        partitions = refine_by_swaps(lengths, partitions, equal_size)
    return sorted(partitions, key=lambda partition: partition[0])


def micro_batch_tokens(seqlens: Sequence[int], indices: Sequence[int], padded: bool = True) -> int:
    """Tokens one micro-batch costs: len(indices) * max length when the trainer pads every row to the
    longest one (`padded=True`), or the plain sum when rows are packed without padding (`padded=False`)."""
    lengths = [int(seqlens[i]) for i in indices]
    if not lengths:
        return 0
    return len(lengths) * max(lengths) if padded else sum(lengths)


def padded_token_count(seqlens: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> int:
    """Tokens the forward passes actually process when each micro-batch is padded to its longest row."""
    return sum(micro_batch_tokens(seqlens, batch, padded=True) for batch in micro_batches)


def token_budget_micro_batches(
    seqlens: Sequence[int], max_tokens: int, same_count_across: int | None = None, padded: bool = True
) -> list[list[int]]:
    """Pack sample indices into micro-batches whose token cost stays within `max_tokens` (dynamic batch size).

    Cost model (`micro_batch_tokens`): with `padded=True` (the default, how the trainer runs) a micro-batch
    is padded to its longest row, so it costs len(batch) * max(seqlen in batch) tokens of compute and
    activation memory; with `padded=False` (padding-free / varlen attention) it costs the plain sum.

    Packing: samples are sorted longest first (ties by index). Padded: micro-batches are consecutive runs
    of that order, so similar lengths share one; the cuts give the fewest micro-batches the budget allows
    and, among those, the fewest padded tokens (`_pack_padded`). Unpadded: first-fit decreasing. A sample
    longer than `max_tokens` gets a micro-batch of its own; nothing is dropped. Micro-batches come out
    longest first (the peak-memory one runs first, so an out-of-memory shows at once), indices ascending.

    `same_count_across`: under FSDP every data-parallel rank must run the same number of forward/backward
    passes or the collectives hang, yet each rank's budget packing may need a different number. Pack once
    without it, all-reduce the count with MAX, and pass that here: the result then has exactly that many
    micro-batches, made by splitting the most expensive ones (which only lowers their cost). Raises if
    the count is below what the budget needs or above the number of samples.
    """
    lengths = _as_lengths(seqlens)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches = _pack_padded(lengths, order, max_tokens) if padded else _pack_first_fit(lengths, order, max_tokens)

    if same_count_across is not None:
        if same_count_across < len(batches):
            raise ValueError(
                f"max_tokens={max_tokens} needs {len(batches)} micro-batches here, more than "
                f"same_count_across={same_count_across}; pass the maximum of the count over all ranks"
            )
        if same_count_across > len(lengths):
            raise ValueError(
                f"same_count_across={same_count_across} micro-batches cannot be filled from {len(lengths)} samples"
            )
        while len(batches) < same_count_across:
            _split_most_expensive(lengths, batches, padded)
    return [sorted(batch) for batch in batches]


def _pack_padded(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Cut the longest-first order into consecutive runs: the fewest micro-batches the budget allows and,
    among those, the fewest padded tokens.

    A run's first sample is its longest, so a run of c samples from position i costs c * L[i]. Filling each
    run to the budget greedily also gives the fewest runs, but it puts the cuts in the wrong places: a run
    that opens with a 700-token response fills up with 100-token ones padded to 700. So a dynamic
    programme picks the cuts: best[j] = (runs, padded tokens) for the first j samples, compared as a pair;
    it looks back only while the run still fits, so it costs O(n * longest run), milliseconds for
    hundreds of samples.
    """
    ordered = [lengths[i] for i in order]
    best: list[tuple[int, int] | None] = [(0, 0)] + [None] * len(ordered)
    cut = [0] * (len(ordered) + 1)
    for end in range(1, len(ordered) + 1):
        for start in range(end - 1, -1, -1):
            size = end - start
            if size > 1 and size * ordered[start] > max_tokens:
                break  # starting earlier only makes the run longer and its first sample longer
            runs, tokens = best[start]
            candidate = (runs + 1, tokens + size * ordered[start])
            if best[end] is None or candidate < best[end]:
                best[end], cut[end] = candidate, start
    batches, end = [], len(ordered)
    while end > 0:
        batches.append(order[cut[end]:end])
        end = cut[end]
    return batches[::-1]


def _pack_first_fit(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing on token sums: each sample goes into the first micro-batch it fits in."""
    batches: list[list[int]] = []
    sums: list[int] = []
    for i in order:
        for b, total in enumerate(sums):
            if total + lengths[i] <= max_tokens:
                batches[b].append(i)
                sums[b] += lengths[i]
                break
        else:
            batches.append([i])
            sums.append(lengths[i])
    return batches


def _split_most_expensive(lengths: list[int], batches: list[list[int]], padded: bool) -> None:
    """Split the costliest micro-batch that has two or more samples into two, in place. Padded batches are
    cut into the longer and the shorter half (the shorter half then pads to a shorter row); unpadded ones
    are split into two halves of near-equal token sum."""
    splittable = [b for b, batch in enumerate(batches) if len(batch) >= 2]
    target = max(splittable, key=lambda b: (micro_batch_tokens(lengths, batches[b], padded), -b))
    batch = sorted(batches[target], key=lambda i: (-lengths[i], i))
    if padded:
        half = (len(batch) + 1) // 2
        first, second = batch[:half], batch[half:]
    else:
        halves = greedy_partition([lengths[i] for i in batch], 2, equal_size=False)
        first, second = ([batch[j] for j in half] for half in halves)
    batches[target:target + 1] = [first, second]


def token_imbalance(seqlens: Sequence[int], partitions: Sequence[Sequence[int]]) -> float:
    """max over partitions of the token sum / the mean token sum: 1.0 is perfect balance, 2.0 means the
    busiest rank does twice the average work (and the step takes about twice as long as it could).
    Logged by the trainer as `balance/token_imbalance`."""
    if not partitions:
        raise ValueError("token_imbalance needs at least one partition")
    lengths = _as_lengths(seqlens)
    sums = [sum(lengths[i] for i in partition) for partition in partitions]
    total = sum(sums)
    if total == 0:
        return 1.0
    return max(sums) / (total / len(sums))


def packed_micro_batches(seqlens: Sequence[int], max_tokens: int, same_count_across: int | None = None
                         ) -> list[list[int]]:
    """Micro-batches for packed rows (``actor.use_remove_padding``): the real tokens of each sum to at most
    ``max_tokens``, and that is all a packed micro-batch costs (the loss reads the predictions of its real
    response tokens only, `scalerl.models.packing`). First-fit decreasing by length (`_pack_first_fit`); a
    sample longer than the budget is an error (a packed row holds whole sequences). ``same_count_across``
    as in `token_budget_micro_batches` (the largest micro-batches are split until the count is reached)."""
    lengths = _as_lengths(seqlens)
    if lengths and max(lengths) > max_tokens:
        raise ValueError(f"actor.micro_batch_max_tokens={max_tokens} is shorter than a sequence of "
                         f"{max(lengths)} tokens; a packed row holds whole sequences (raise the budget)")
    batches = _pack_first_fit(lengths, sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), max_tokens)
    if same_count_across is not None:
        if not len(batches) <= same_count_across <= len(lengths):
            raise ValueError(f"same_count_across={same_count_across} must lie between the {len(batches)} "
                             f"micro-batches the budget needs and the {len(lengths)} samples")
        while len(batches) < same_count_across:
            _split_most_expensive(lengths, batches, padded=False)
    return [sorted(batch) for batch in batches]


def sequence_lengths(attention_mask):
    """Real tokens per row ``[B]`` of an ``attention_mask`` ``[B, T]``: the count that balancing across DP
    ranks (`balance_across_ranks` in `scalerl.trainer.rollout_rebalance`) and the packed micro-batch budget
    (`packed_micro_batches`) both use, so a rank's share is what its packed micro-batches process."""
    return attention_mask.long().sum(-1)
