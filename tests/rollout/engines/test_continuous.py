"""Continuous batching: a request's output is its own whatever shares the batch, freed slots are refilled at
once, tokens record the weight version, and ``generate`` through it equals the fixed batch."""

import pytest
import torch

from scalerl.models.kv_cache import SlotKVCache
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.continuous import ContinuousEngine, GenerationRequest
from scalerl.rollout.engines.engine import PromptTooLongError, SamplingParams
from tests.rollout.engines.test_builtin import _full_forward_logprobs
from tests.rollout.engines.test_compaction import NATURAL_STOPS, PAD, VOCAB, ForcedStops
from tests.tiny import tiny_model

MAX_PROMPT, MAX_NEW = 10, 24


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=VOCAB, hidden_size=64, intermediate_size=112).eval()


def _prompts(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(9, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, MAX_PROMPT + 1, (n,), generator=g)]


SAMPLINGS = [
    {"temperature": 1.0, "stop_token_ids": NATURAL_STOPS},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": NATURAL_STOPS},
    {"temperature": 0.0, "stop_token_ids": [11, 30, 47]},
]


def _requests(prompts, sampling, max_new=MAX_NEW):
    """Request ``i`` has seed ``100 + i`` and, for variety, its own length limit."""
    return [GenerationRequest(i, p, SamplingParams(max_new_tokens=max_new - (i % 3) * 5, seed=100 + i, **sampling))
            for i, p in enumerate(prompts)]


class ForwardShapes:
    """Records ``(rows, tokens per row)`` of every forward the model runs."""

    def __init__(self, model):
        self.shapes: list[tuple[int, int]] = []
        self.handle = model.register_forward_pre_hook(lambda _, args: self.shapes.append(tuple(args[0].shape)))

    def __enter__(self):
        return self.shapes

    def __exit__(self, *exc):
        self.handle.remove()


def _run(model, requests, max_num_seqs, **kw):
    engine = ContinuousEngine(model, PAD, max_num_seqs, MAX_PROMPT, MAX_NEW, **kw)
    return {o.request_id: o for o in engine.generate_stream(requests)}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_requests_output_does_not_depend_on_what_shares_the_batch(model, sampling):
    prompts = _prompts()
    alone = {i: _run(model, [r], 1)[i] for i, r in enumerate(_requests(prompts, sampling))}
    lengths = {len(o.token_ids) for o in alone.values()}
    assert len(lengths) > 2  # rows finish at different steps, so slots free up at different times
    for max_num_seqs, check_every in [(1, 4), (3, 1), (5, 2), (12, 4)]:
        mixed = _run(model, _requests(prompts, sampling), max_num_seqs, finish_check_every=check_every)
        assert sorted(mixed) == sorted(alone)
        for i, o in mixed.items():
            assert torch.equal(o.token_ids, alone[i].token_ids), (max_num_seqs, i)
            assert (o.logprobs - alone[i].logprobs).abs().max() < 1e-5
            assert o.finish_reason == alone[i].finish_reason


@pytest.mark.parametrize("fused", [False, True], ids=["model", "fused"])
def test_a_request_admitted_mid_way_never_reads_uninitialised_cache_memory(model, monkeypatch, fused):
    """The columns left of a late request's prompt are masked yet still multiplied: fresh memory that held a
    NaN there made every later token of that request NaN (seen in the agent loop, where turns arrive late).
    Here every fresh float tensor holds NaN, as reused memory may."""
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    first, late = GenerationRequest(0, [15, 16, 17], sampling), GenerationRequest(1, [19, 20, 21, 22, 23], sampling)

    def outputs():
        engine = BuiltinEngine(model, PAD).continuous_engine(MAX_PROMPT, MAX_NEW, max_num_seqs=4) if fused else \
            ContinuousEngine(model, PAD, 4, MAX_PROMPT, MAX_NEW, finish_check_every=2)
        engine.submit(first)
        done = engine.step()  # the first request is in flight at a later column when the second one comes
        engine.submit(late)
        while engine.has_unfinished():
            done += engine.step()
        return {o.request_id: o for o in done}

    clean = outputs()
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_filled)
    poisoned = outputs()
    for i in (0, 1):
        assert torch.isfinite(poisoned[i].logprobs).all(), i
        assert torch.equal(poisoned[i].token_ids, clean[i].token_ids), i


@pytest.mark.parametrize("fused", [False, True], ids=["model", "fused"])
def test_a_conversations_next_turn_prefills_only_its_new_tokens_and_samples_the_same(model, fused):
    """Prefix reuse: turn 2's prompt is turn 1's prompt + completion + new tokens; with ``reuse_from`` only the
    last completion token and the new ones run through a prefill, over turn 1's kept keys and values (a row that
    stopped early leaves overrun columns behind, which are not kept), and it samples what a fresh engine
    re-encoding the whole prompt samples."""
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, stop_token_ids=NATURAL_STOPS)

    def engine():
        return BuiltinEngine(model, PAD).continuous_engine(MAX_PROMPT + 30, MAX_NEW, max_num_seqs=4) if fused else \
            ContinuousEngine(model, PAD, 4, MAX_PROMPT + 30, MAX_NEW, finish_check_every=4)

    reused, fresh = engine(), engine()
    first = {o.request_id: o for o in reused.generate_stream([
        GenerationRequest(i, p, sampling, keep_kv=True) for i, p in enumerate(_prompts(3, seed=4))])}
    assert sorted(reused.kept) == [0, 1, 2]
    assert any(len(o.token_ids) < 12 and o.finish_reason == "stop" for o in first.values())  # overrun columns
    turns = [GenerationRequest(10 + i, list(o.prompt_ids) + o.token_ids.tolist() + [40 + i, 41], sampling,
                               reuse_from=i) for i, o in first.items()]
    before = reused.prefill_tokens
    second = {o.request_id: o for o in reused.generate_stream(turns)}
    assert reused.prefill_tokens - before == 3 * 3  # per turn: the last sampled token and the two new ones
    assert not reused.kept  # each kept prefix is used once
    again = {o.request_id: o for o in fresh.generate_stream(
        [GenerationRequest(t.request_id, t.prompt_ids, sampling) for t in turns])}
    assert fresh.prefill_tokens == sum(len(t.prompt_ids) for t in turns)
    for i, o in second.items():
        assert torch.equal(o.token_ids, again[i].token_ids), i
        assert (o.logprobs - again[i].logprobs).abs().max() < 1e-5
    # A prompt that does not start with the kept tokens is prefilled whole; kept prefixes are bounded.
    kept = reused.generate_stream([GenerationRequest(20, [15, 16, 17], sampling, keep_kv=True)])
    list(kept)
    before = reused.prefill_tokens
    list(reused.generate_stream([GenerationRequest(21, [15, 99 % VOCAB, 17, 18], sampling, reuse_from=20)]))
    assert reused.prefill_tokens - before == 4
    list(reused.generate_stream([GenerationRequest(30 + i, [15 + i, 16], sampling, keep_kv=True) for i in range(10)]))
    assert sorted(reused.kept) == list(range(32, 40))  # 2 x max_num_seqs: the oldest went first
    reused.release(list(reused.kept))
    assert not reused.kept


def test_a_request_alone_equals_the_fixed_batch_engine_on_it(model):
    prompt = _prompts()[3]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5, stop_token_ids=NATURAL_STOPS)
    fixed = BuiltinEngine(model, PAD).generate([prompt], sampling)
    out = _run(model, [GenerationRequest(0, prompt, sampling)], 4)[0]
    n = int(fixed.response_mask.sum())
    assert torch.equal(out.token_ids, fixed.response_ids[0, :n])
    assert (out.logprobs - fixed.logprobs[0, :n]).abs().max() < 1e-5


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_generate_through_continuous_batching_equals_the_fixed_batch(model, sampling):
    prompts, params = _prompts(), SamplingParams(max_new_tokens=MAX_NEW, seed=3, **sampling)
    fixed = BuiltinEngine(model, PAD).generate(prompts, params)
    for max_num_seqs in (1, 4, 11):
        out = BuiltinEngine(model, PAD, max_num_seqs=max_num_seqs).generate(prompts, params)
        assert torch.equal(out.prompt_ids, fixed.prompt_ids) and torch.equal(out.response_ids, fixed.response_ids)
        assert torch.equal(out.response_mask, fixed.response_mask) and out.finish_reasons == fixed.finish_reasons
        assert (out.logprobs - fixed.logprobs).abs().max() < 1e-5


def test_logprobs_equal_full_forward_through_continuous_batching(model):
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.9, seed=2, stop_token_ids=NATURAL_STOPS)
    out = BuiltinEngine(model, PAD, max_num_seqs=3).generate(_prompts(), sampling)
    assert BuiltinEngine.logprobs_match_training_forward and ContinuousEngine.logprobs_match_training_forward
    ref = _full_forward_logprobs(model, out, sampling.temperature)
    m = out.response_mask.bool()
    assert (out.logprobs[m] - ref[m]).abs().max().item() < 1e-5


def test_freed_slots_are_refilled_at_once_with_batched_prefills(model):
    lengths = [3, 3, 3, 3, 9, 9, 9, 9, 5, 5, 5, 5]  # forced stop lengths, by request id
    prompts = _prompts()
    requests = [GenerationRequest(i, p, SamplingParams(max_new_tokens=MAX_NEW, seed=i, stop_token_ids=[1]))
                for i, p in enumerate(prompts)]
    engine = ContinuousEngine(model, PAD, 4, MAX_PROMPT, MAX_NEW, finish_check_every=1,
                              logits_processor=ForcedStops(lengths))
    with ForwardShapes(model) as rows:
        outputs = list(engine.generate_stream(requests))
    assert [len(o.token_ids) for o in sorted(outputs, key=lambda o: o.request_id)] == lengths
    prefills = [n for n, seq in rows if seq > 1]
    decode_rows = [n for n, seq in rows if seq == 1]
    assert prefills[0] == 4 and max(prefills[1:]) > 1  # the first batch and later refills prefill together
    # Every decode step runs 4 rows while requests wait: the slots a finished row frees are filled before
    # the next step. Decode work is about the tokens generated, not batches x longest.
    tokens = sum(lengths)
    assert sum(decode_rows) <= tokens + 4 * len(prefills)
    fixed_batches = sum(max(lengths[i : i + 4]) for i in range(0, 12, 4))
    assert len(decode_rows) < fixed_batches


def test_tokens_record_the_weight_version_they_were_sampled_with(model):
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    engine = ContinuousEngine(model, PAD, 2, MAX_PROMPT, MAX_NEW, finish_check_every=3)
    for i, p in enumerate(_prompts(2)):
        engine.submit(GenerationRequest(i, p, sampling))
    assert engine.step() == [] and engine.num_running == 2
    engine.weight_version = 7  # weights loaded between steps: the rows in flight continue with them
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    for o in outputs:
        assert o.weight_versions.tolist() == [0] * 4 + [7] * (MAX_NEW - 4)  # prefill + 3 decode steps before


def test_new_weights_take_effect_for_rows_in_flight(model):
    """Loading weights between steps changes the next tokens' log-probs (rows continue with the new weights)."""
    import copy

    other = copy.deepcopy(model)
    prompt, sampling = _prompts(1)[0], SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    engine = ContinuousEngine(other, PAD, 1, MAX_PROMPT, MAX_NEW, finish_check_every=4)
    engine.submit(GenerationRequest(0, prompt, sampling))
    engine.step()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    engine.weight_version = 1
    out = next(o for _ in range(10) for o in engine.step())
    same = _run(model, [GenerationRequest(0, prompt, sampling)], 1)[0]
    assert torch.equal(out.token_ids[:5], same.token_ids[:5]) and torch.equal(out.logprobs[:5], same.logprobs[:5])
    assert not torch.allclose(out.logprobs[5:], same.logprobs[5:])


def test_long_streams_move_the_cache_columns_without_changing_outputs(model, monkeypatch):
    moves = []
    original = SlotKVCache.move_columns
    monkeypatch.setattr(SlotKVCache, "move_columns", lambda self, *a: (moves.append(a), original(self, *a))[1])
    prompts, sampling = _prompts(30, seed=4), {"temperature": 1.0}  # no stop: responses of 14-24 tokens
    alone = {i: _run(model, [r], 1)[i] for i, r in enumerate(_requests(prompts, sampling))}
    moves.clear()
    mixed = _run(model, _requests(prompts, sampling), 4)
    assert any(to < first for first, _, to, _ in moves)  # live columns moved back to the front
    for i, o in mixed.items():
        assert torch.equal(o.token_ids, alone[i].token_ids)


def test_sliding_window_model_gives_the_same_outputs_alone_and_mixed():
    model = tiny_model(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"]).eval()
    prompts, sampling = _prompts(8), SAMPLINGS[0]
    fixed = BuiltinEngine(model, PAD).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, seed=3, **sampling))
    out = BuiltinEngine(model, PAD, max_num_seqs=3).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, seed=3,
                                                                                      **sampling))
    assert torch.equal(out.response_ids, fixed.response_ids)
    assert (out.logprobs - fixed.logprobs).abs().max() < 1e-5


def test_requests_with_other_sampling_filters_wait_for_the_rows_in_flight(model):
    prompts = _prompts(4)
    sampled = [GenerationRequest(i, p, SamplingParams(max_new_tokens=8, seed=i)) for i, p in enumerate(prompts[:3])]
    greedy = GenerationRequest(3, prompts[3], SamplingParams(max_new_tokens=8, temperature=0.0))
    engine = ContinuousEngine(model, PAD, 4, MAX_PROMPT, MAX_NEW, finish_check_every=2)
    for r in sampled + [greedy]:
        engine.submit(r)
    engine.step()
    assert engine.num_running == 3 and len(engine.waiting) == 1  # a slot is free, but the filters differ
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert torch.equal(outputs[3].token_ids, _run(model, [greedy], 1)[3].token_ids)


def test_the_stream_is_read_as_slots_need_it(model):
    pulled = []

    def arriving():
        for i, p in enumerate(_prompts(20)):
            pulled.append(i)
            yield GenerationRequest(i, p, SamplingParams(max_new_tokens=4, seed=i))

    stream = ContinuousEngine(model, PAD, 2, MAX_PROMPT, MAX_NEW).generate_stream(arriving())
    next(stream)
    assert len(pulled) <= 4
    assert len(list(stream)) == 19


def test_bad_requests_are_refused(model):
    engine = ContinuousEngine(model, PAD, 2, MAX_PROMPT, MAX_NEW)
    with pytest.raises(ValueError, match="max_prompt_len"):
        engine.submit(GenerationRequest(0, [5] * (MAX_PROMPT + 1), SamplingParams(max_new_tokens=4)))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(GenerationRequest(0, [], SamplingParams(max_new_tokens=4)))
    short = tiny_model(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, max_position_embeddings=16).eval()
    with pytest.raises(PromptTooLongError, match="max_position_embeddings"):
        ContinuousEngine(short, PAD, 2, MAX_PROMPT, MAX_NEW).submit(
            GenerationRequest(0, [5] * 8, SamplingParams(max_new_tokens=MAX_NEW)))
    with pytest.raises(ValueError, match="max_num_seqs"):
        ContinuousEngine(model, PAD, 0, MAX_PROMPT, MAX_NEW)


def test_aborted_requests_free_their_slots_and_leave_the_others_unchanged(model):
    requests = _requests(_prompts(6), {"temperature": 1.0})  # no stop tokens: nothing finishes in the first step
    alone = {r.request_id: _run(model, [r], 1)[r.request_id] for r in _requests(_prompts(6), {"temperature": 1.0})}
    engine = ContinuousEngine(model, PAD, 3, MAX_PROMPT, MAX_NEW, finish_check_every=1)
    for r in requests:
        engine.submit(r)
    engine.step()
    assert engine.abort([0, 4, 99]) == 2 and engine.num_running == 2 and len(engine.waiting) == 2
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert sorted(outputs) == [1, 2, 3, 5]
    for i, o in outputs.items():
        assert torch.equal(o.token_ids, alone[i].token_ids)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_the_engine_handed_out_decodes_on_the_fused_path_with_the_fixed_batch_tokens(model, sampling):
    prompts, params = _prompts(), SamplingParams(max_new_tokens=MAX_NEW, seed=3, **sampling)
    fixed = BuiltinEngine(model, PAD).generate(prompts, params)
    engine = BuiltinEngine(model, PAD, max_num_seqs=4).continuous_engine(MAX_PROMPT, MAX_NEW)
    assert engine.decode_model is not None and engine.forward is engine.decode_model
    requests = [GenerationRequest(i, p, SamplingParams(**{**vars(params), "row_offset": i, "total_rows": len(prompts)}))
                for i, p in enumerate(prompts)]
    with ForwardShapes(model) as shapes:  # the model's own forward never runs
        fused = {o.request_id: o for o in engine.generate_stream(requests)}
    assert shapes == []
    unfused = _run(model, requests, 4)
    for i, o in fused.items():
        n = int(fixed.response_mask[i].sum())
        assert torch.equal(o.token_ids, fixed.response_ids[i, :n]) and torch.equal(o.token_ids, unfused[i].token_ids)
        assert (o.logprobs - fixed.logprobs[i, :n]).abs().max() < 1e-5
        assert (o.logprobs - unfused[i].logprobs).abs().max() < 1e-5


def test_fused_rows_in_flight_continue_with_weights_written_between_steps(model):
    import copy

    other = copy.deepcopy(model)
    prompt, sampling = _prompts(1)[0], SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    engine = BuiltinEngine(other, PAD, finish_check_every=4).continuous_engine(MAX_PROMPT, MAX_NEW, 1)
    engine.submit(GenerationRequest(0, prompt, sampling))
    engine.step()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    out = next(o for _ in range(10) for o in engine.step())
    before = _run(model, [GenerationRequest(0, prompt, sampling)], 1)[0]
    after = _run(other, [GenerationRequest(0, prompt, sampling)], 1)[0]
    assert torch.equal(out.token_ids[:5], before.token_ids[:5])
    assert (out.logprobs[:5] - before.logprobs[:5]).abs().max() < 1e-5
    assert not torch.allclose(out.logprobs[5:], before.logprobs[5:])
    assert not engine.decode_model.is_stale()  # laid out again at the step after the write
    assert (out.logprobs[5:] - after.logprobs[5:]).abs().max() > 0  # a mix, not the new weights' run either


def test_bf16_continuous_engine_decodes_in_bf16_and_says_its_logprobs_differ(model):
    engine = BuiltinEngine(model, PAD, dtype=torch.bfloat16, max_num_seqs=4).continuous_engine(MAX_PROMPT, MAX_NEW)
    assert engine.decode_model.dtype == torch.bfloat16 and not engine.logprobs_match_training_forward
    outputs = list(engine.generate_stream(_requests(_prompts(6), SAMPLINGS[2])))
    assert len(outputs) == 6 and all(o.token_ids.numel() > 0 for o in outputs)
