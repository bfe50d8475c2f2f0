"""Finished rows leave the decode batch: same outputs as stepping every row, less work, ranks in lockstep."""

import itertools

import pytest
import torch

from scalerl.models.kv_cache import KVCache
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.tiny import tiny_model

PAD, VOCAB = 0, 64
NATURAL_STOPS = list(range(3, 9))  # 6 of 64 tokens: sampled rows stop at widely different steps


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=VOCAB, hidden_size=64, intermediate_size=112).eval()


def _prompts(n=12):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(9, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, 10, (n,), generator=g)]


class ForcedStops:
    """Logits processor: row ``i`` emits ``stop`` at step ``lengths[i] - 1`` and never before."""

    def __init__(self, lengths, stop=1):
        self.last_step, self.stop = torch.as_tensor(lengths) - 1, stop

    def __call__(self, logits, rows, step):
        at_stop = (self.last_step[rows] == step).unsqueeze(1)
        forced = torch.full_like(logits, float("-inf"))
        forced[:, self.stop] = 0.0
        banned = logits.clone()
        banned[:, self.stop] = float("-inf")
        return torch.where(at_stop, forced, banned)


class RowsPerForward:
    """Records the batch size of every forward the model runs (at its embedding, which the model's own and
    the fused decode forward both call)."""

    def __init__(self, model):
        self.sizes: list[int] = []
        self.handle = model.embed_tokens.register_forward_pre_hook(lambda _, args: self.sizes.append(args[0].shape[0]))

    def __enter__(self):
        return self.sizes

    def __exit__(self, *exc):
        self.handle.remove()


SAMPLINGS = [
    SamplingParams(max_new_tokens=24, temperature=1.0, seed=1, stop_token_ids=NATURAL_STOPS),
    SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=20, seed=2, stop_token_ids=NATURAL_STOPS),
    SamplingParams(max_new_tokens=24, temperature=0.0),  # stop ids: see _with_greedy_stops
]


def _with_greedy_stops(model, sampling):
    """Greedy rows of a random model rarely meet a fixed stop set; stop on tokens they do emit, early and late."""
    if sampling.temperature > 0:
        return sampling
    free = BuiltinEngine(model, PAD).generate(_prompts(), sampling).response_ids
    stops = {int(free[i, (3 * i) % free.shape[1]]) for i in range(0, len(free), 2)}
    return SamplingParams(**{**vars(sampling), "stop_token_ids": sorted(stops)})


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("compact_at,check_every", [(0.01, 1), (0.25, 4), (0.5, 2)])
def test_compacting_matches_stepping_every_row(model, sampling, compact_at, check_every):
    sampling = _with_greedy_stops(model, sampling)
    stepping = BuiltinEngine(model, PAD, finish_check_every=check_every, compact_at=None).generate(_prompts(), sampling)
    compacting = BuiltinEngine(model, PAD, finish_check_every=check_every, compact_at=compact_at)
    with RowsPerForward(model) as sizes:
        out = compacting.generate(_prompts(), sampling)
    assert min(sizes) < len(_prompts())  # rows did leave the batch
    assert torch.equal(out.response_ids, stepping.response_ids)
    assert torch.equal(out.response_mask, stepping.response_mask)
    assert out.finish_reasons == stepping.finish_reasons
    assert (out.logprobs - stepping.logprobs).abs().max().item() < 1e-5


@pytest.mark.parametrize("sampling", SAMPLINGS[:2])
def test_a_rows_sample_depends_only_on_its_global_row(model, sampling):
    """Each row generated alone (as rank `i` of a split batch would) samples what it does in the batch."""
    prompts = _prompts()
    batched = BuiltinEngine(model, PAD, finish_check_every=1, compact_at=0.01).generate(prompts, sampling)
    for i, prompt in enumerate(prompts):
        alone_sampling = SamplingParams(**{**vars(sampling), "row_offset": i, "total_rows": len(prompts)})
        alone = BuiltinEngine(model, PAD).generate([prompt], alone_sampling)
        n = int(alone.response_lengths[0])
        assert torch.equal(alone.response_ids[0, :n], batched.response_ids[i, :n])
        assert int(batched.response_lengths[i]) == n


def test_logprobs_equal_full_forward_after_compaction(model):
    out = BuiltinEngine(model, PAD, finish_check_every=1, compact_at=0.01).generate(_prompts(), SAMPLINGS[0])
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).float()
    p = out.prompt_ids.shape[1]
    ref = logits[:, p - 1 : -1].log_softmax(-1).gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)
    m = out.response_mask.bool()
    assert (out.logprobs[m] - ref[m]).abs().max().item() < 1e-5


def test_finished_rows_stop_costing_decode_work(model):
    lengths = [2, 2, 3, 3, 4, 4, 5, 6, 8, 10, 14, 20]
    sampling = SamplingParams(max_new_tokens=20, seed=0, stop_token_ids=[1])
    engine = BuiltinEngine(model, PAD, finish_check_every=1, compact_at=0.01, logits_processor=ForcedStops(lengths))
    with RowsPerForward(model) as sizes:
        out = engine.generate(_prompts(), sampling)
    assert out.response_lengths.tolist() == lengths
    # Prefill, then decode steps 1..19; the step after t sees the rows whose length exceeds t + 1.
    assert sizes == [12] + [sum(n > t + 1 for n in lengths) for t in range(19)]
    assert sum(sizes[1:]) == sum(lengths) - len(lengths)  # exactly one forward per non-final token


def test_waiting_for_other_ranks_keeps_one_row_stepping(model):
    """All local rows done, other ranks not (yet): one stand-in row keeps joining the forwards."""
    votes = []

    def other_ranks_busy_until_step_9(flag):
        votes.append(flag)
        return flag and len(votes) >= 9

    sampling = SamplingParams(max_new_tokens=20, seed=0, stop_token_ids=[1])
    engine = BuiltinEngine(model, PAD, finish_check_every=1, compact_at=0.01, all_finished=other_ranks_busy_until_step_9,
                           logits_processor=ForcedStops([2, 3, 3]))
    with RowsPerForward(model) as sizes:
        out = engine.generate(_prompts(3), sampling)
    assert out.response_lengths.tolist() == [2, 3, 3]
    assert sizes == [3, 3, 2, 1, 1, 1, 1, 1, 1]  # prefill + 8 decode steps, as many as the busiest rank's
    assert votes == [False, False] + [True] * 7


def test_kv_cache_keep_rows_reorders_the_filled_prefix():
    cache = KVCache(num_layers=2, batch_size=5, max_len=6)
    k = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 2, 3, 2).contiguous()
    for layer in range(2):
        cache.update(layer, k, -k, start=0)
    cache.keep_rows(torch.tensor([0, 4, 2]), filled=3)  # new row i = old row keep[i]
    keys, values = cache.update(1, torch.full((3, 2, 1, 2), 9.0), torch.full((3, 2, 1, 2), -9.0), start=3)
    assert keys.shape == (3, 2, 4, 2)
    assert keys[:, 1, :3, 1].tolist() == [[0.0] * 3, [4.0] * 3, [2.0] * 3] and (keys[:, :, 3] == 9).all()
    assert values[:, 0, :3, 0].tolist() == [[0.0] * 3, [-4.0] * 3, [-2.0] * 3]


def test_compaction_moves_back_rows_into_finished_places():
    from scalerl.rollout.engines.builtin import _rows_to_keep

    unfinished = torch.tensor([True, False, True, False, True, True])
    assert _rows_to_keep(unfinished, 4).tolist() == [0, 4, 2, 5]  # rows 0 and 2 stay put: two rows copied
    assert _rows_to_keep(torch.tensor([False, True, True]), 2).tolist() == [2, 1]
    assert _rows_to_keep(torch.zeros(3, dtype=torch.bool), 0).tolist() == [0]  # a stand-in row


def test_threshold_decides_when_to_compact(model):
    engine = BuiltinEngine(model, PAD, compact_at=0.25)
    decisions = {(rows, left): engine._should_compact(rows, left) for rows, left in itertools.product((1, 4, 8), range(9))}
    assert decisions[(8, 7)] is False and decisions[(8, 6)] is True  # 2 of 8 finished reaches 25%
    assert decisions[(4, 3)] is True and decisions[(1, 0)] is False  # a lone row stays (stand-in)
    assert not any(BuiltinEngine(model, PAD, compact_at=None)._should_compact(8, n) for n in range(8))
