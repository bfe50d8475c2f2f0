"""A streaming rollout worker (rollout.partial=true) driven over gloo by a trainer-like rank 0: a weight push
that lands mid-generation is loaded between two engine steps and the rows in flight continue with the new
weights (their tokens after the push are what the new weights produce from that prefix, their KV cache
kept), every token tagged with the version that sampled it; replies come as requests finish, out of order,
each naming its step and rows; without a push the stream samples what the fixed batch samples.

One spawned group (trainer rank 0 + worker rank 1) runs every scenario; the checks run here on what rank 0
returns."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

MAX_NEW = 40
CFG = tiny_overrides("rollout.placement=standalone", "rollout.staleness=1", "rollout.partial=true",
                     f"rollout.max_new_tokens={MAX_NEW}", "rollout.max_num_seqs=8")
PROMPTS = [[5, 9, 13, 2], [7, 3], [11, 12, 4, 6, 8, 10]]


def _scenarios(rank: int) -> dict | None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from scalerl.comm.counting.accounting import CommCounter
    from scalerl.comm.weights.channel import BroadcastChannel
    from scalerl.comm.weights.sender import WeightSender
    from scalerl.core.config import load_config
    from scalerl.models.load import load_model_and_tokenizer
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams, left_pad
    from scalerl.rollout.worker.protocol import WorkerDriver
    from scalerl.rollout.worker.worker import RolloutWorker

    cfg = load_config(None, CFG)
    group = dist.new_group([0, 1])
    cpu = torch.device("cpu")
    if rank == 1:
        RolloutWorker(cfg, cpu, group).serve()
        return None
    model, tokenizer = load_model_and_tokenizer(cfg.model, None, cpu, cfg.trainer.seed)
    model.eval().requires_grad_(False)
    pad = tokenizer.pad_token_id
    driver = WorkerDriver(SimpleNamespace(rollout_ranks=[1], device=cpu, comm=CommCounter()))
    sender = WeightSender.from_config(cfg.weight_sync, "fp32", BroadcastChannel(group, src=0))
    version = 0

    def push():
        nonlocal version
        driver.announce_weights(version)
        sender.sync(list(model.named_parameters()))
        version += 1

    def push_during(step, prompts, sampling, change):
        """A request with a push of ``change`` behind it, the worker held by a push of the same weights
        before them both, so it reads the request and the WEIGHTS of the change together: the change lands
        after the request's first engine step (versions v, then v + 1)."""
        nonlocal version
        driver.announce_weights(version)
        request(step, prompts, sampling)
        driver.announce_weights(version + 1)
        sender.sync(list(model.named_parameters()))
        with torch.no_grad():
            change()
        sender.sync(list(model.named_parameters()))
        version += 2

    def request(step, prompts, sampling):
        ids, mask = left_pad(prompts, pad)
        driver.request_generation(1, step, sampling, ids, mask.sum(-1), tokens=0)

    def greedy(m, prompts, max_new):
        out = BuiltinEngine(m, pad).generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0))
        return [out.response_ids[i, : int(out.response_mask[i].sum())].tolist() for i in range(len(prompts))]

    def rows(reply):
        out = reply.out
        n = out.response_mask.sum(-1).tolist()
        return ([out.response_ids[i, :k].tolist() for i, k in enumerate(n)],
                [out.weight_versions[i, :k].tolist() for i, k in enumerate(n)], out)

    results = {}
    push()  # version 0, the full push a run starts with
    no_stop = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, total_rows=len(PROMPTS))

    # 1. A push that changes only the final norm (the logits, not the keys and values) lands mid-generation:
    # the tokens after it are exactly the new weights' greedy continuation of the prefix.
    before = copy.deepcopy(model)
    push_during(1, PROMPTS, no_stop, lambda: model.norm.weight.mul_(-1.5))  # versions 1 (as before), 2
    tokens, versions, _ = rows(driver.collect(1, 0))
    continuations = []
    for prompt, toks, vers in zip(PROMPTS, tokens, versions):
        switch = vers.index(2) if 2 in vers else len(vers)
        continuations.append((toks[:switch], greedy(model, [prompt + toks[:switch]], MAX_NEW - switch)[0]
                              if switch < MAX_NEW else []))
    results["norm_push"] = dict(tokens=tokens, versions=versions, old=greedy(before, PROMPTS, MAX_NEW),
                                continuations=continuations)

    # 2. A push that changes every weight: the rows continue from their KV cache with the new weights, as a
    # single-process engine does when its weights change between the same two steps.
    before = copy.deepcopy(model)

    def perturb():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))

    push_during(2, PROMPTS, no_stop, perturb)  # versions 3 (as before), 4
    after = copy.deepcopy(model)
    tokens, versions, out = rows(driver.collect(2, 0))
    results["full_push"] = dict(tokens=tokens, versions=versions, logprobs=out.logprobs,
                                reference=_swap_mid_stream(before, after, pad, PROMPTS, no_stop, versions))

    # 3. Replies as requests finish: a long request, then a short one, answered short first. The push
    # announced before both holds the worker (in its load, which ends only with the push sent after both
    # requests) so that neither starts before both were sent. Its inbox thread can still be descheduled past
    # the long one's 40 steps before it has read the short one (seen twice in CI, once with the push announced
    # between them, once before both), so the pair is sent up to three times: a worker that answers in the
    # order it was asked fails every time.
    for attempt in range(3):
        step = 3 + 2 * attempt
        driver.announce_weights(version)
        request(step, PROMPTS[:1], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
        request(step + 1, PROMPTS[1:], SamplingParams(max_new_tokens=3, temperature=0.0, row_offset=1))
        sender.sync(list(model.named_parameters()))  # the same weights
        version += 1
        first, second = driver.receive(1), driver.receive(1)
        results["order"] = [(first.step - 2 * attempt, first.row_start), (second.step - 2 * attempt, second.row_start)]
        results["short_lengths"] = first.out.response_mask.sum(-1).tolist()
        if first.step == step + 1:
            break

    # 4. No push while decoding: seeded samples of a part of a step (rows 2..4 of 6) equal the fixed batch's.
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, row_offset=2, total_rows=6,
                             stop_token_ids=[tokenizer.eos_token_id])
    request(10, PROMPTS, sampled)
    fixed = BuiltinEngine(model, pad).generate(PROMPTS, sampled)
    streamed = driver.collect(10, 2).out
    results["seeded"] = dict(fixed=fixed, streamed=streamed, version=version - 1)

    # 5. STOP with a request still decoding: the worker drops it and returns.
    request(11, PROMPTS, no_stop)
    driver.stop()
    return results


def _swap_mid_stream(before, after, pad, prompts, sampling, versions):
    """The tokens one process's continuous engine gives when its weights change from ``before`` to ``after``
    where the worker's did (at the first token of version 4), the rows' KV cache kept. Every row started at
    the first step, which samples 1 + finish_check_every tokens, each later step finish_check_every."""
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.continuous import GenerationRequest

    engine = BuiltinEngine(before, pad).continuous_engine(64, MAX_NEW, 8)
    every = engine.finish_check_every
    switch = versions[0].index(4)
    assert all(v.index(4) == switch for v in versions) and (switch - 1) % every == 0
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(i, p, sampling))
    outputs, steps = {}, 0
    while engine.has_unfinished():
        if steps == (switch - 1) // every:
            with torch.no_grad():
                for p, q in zip(before.parameters(), after.parameters()):
                    p.copy_(q)
        outputs.update({o.request_id: o for o in engine.step()})
        steps += 1
    return [outputs[i].token_ids.tolist() for i in range(len(prompts))]


@pytest.fixture(scope="module")
def scenarios():
    return run_in_group(_scenarios, 2, timeout_s=300)[0]


def test_a_push_mid_generation_continues_the_rows_with_the_new_weights(scenarios):
    s = scenarios["norm_push"]
    assert all(len(t) == MAX_NEW for t in s["tokens"])  # nothing lost, every row to its limit
    for toks, vers, old, (prefix, continuation) in zip(s["tokens"], s["versions"], s["old"], s["continuations"]):
        assert vers == sorted(vers) and set(vers) == {1, 2}  # two versions, the old first
        switch = vers.index(2)
        assert 0 < switch < MAX_NEW
        assert toks[:switch] == old[:switch]  # before the push: the old weights' tokens
        assert toks[switch:] == continuation  # after: the new weights' from that prefix


def test_a_full_weight_change_continues_from_the_kept_kv_cache(scenarios):
    s = scenarios["full_push"]
    assert all(set(v) == {3, 4} for v in s["versions"])
    assert s["tokens"] == s["reference"]
    assert torch.isfinite(s["logprobs"]).all()


def test_replies_come_as_requests_finish_and_name_their_rows(scenarios):
    assert scenarios["order"] == [(4, 1), (3, 0)]
    assert scenarios["short_lengths"] == [3, 3]


def test_without_a_push_the_stream_samples_what_the_fixed_batch_samples(scenarios):
    fixed, streamed = scenarios["seeded"]["fixed"], scenarios["seeded"]["streamed"]
    assert torch.equal(streamed.response_mask, fixed.response_mask)
    assert torch.equal(streamed.response_ids, fixed.response_ids)
    assert torch.equal(streamed.prompt_ids, fixed.prompt_ids)
    assert torch.allclose(streamed.logprobs, fixed.logprobs, atol=1e-5)
    assert streamed.finish_reasons == fixed.finish_reasons
    assert set(streamed.weight_versions[streamed.response_mask.bool()].tolist()) == {scenarios["seeded"]["version"]}


def test_vllm_start_weights_are_saved_only_after_the_checks_and_removed_if_the_engine_fails(tmp_path, monkeypatch):
    from scalerl.core.config import load_config
    from scalerl.core.errors import UserError
    from scalerl.rollout.engines import vllm as vllm_engine
    from tests.tiny import tiny_model

    cfg = load_config(None, [*CFG, "rollout.engine=vllm"])
    saved = tmp_path / "vllm_initial_weights"
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"refuses head_dim 8 \(< 32\) of this model.*rollout.engine=builtin"):
        with vllm_engine.vllm_start_weights(tiny_model(), cfg, tmp_path):
            pass
    assert not saved.exists()  # refused before anything was written
    wide = tiny_model(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(RuntimeError, match="engine failed"):
        with vllm_engine.vllm_start_weights(wide, cfg, tmp_path) as source:
            assert (Path(source) / "config.json").is_file()
            raise RuntimeError("engine failed")
    assert not saved.exists()  # the engine's own failure takes its start weights with it


def test_the_streaming_engine_for_vllm_comes_from_its_module(tmp_path, monkeypatch):
    """rollout.engine=vllm: the worker's streaming engine is `streaming_vllm_engine(cfg, model_dir,
    pad_token_id)` started on the model's weights saved in the worker's scratch directory; without that
    module, an error naming rollout.partial and the way out."""
    import sys
    import types

    from scalerl.core.config import load_config
    from scalerl.core.errors import UserError
    from scalerl.rollout.engines import vllm as vllm_engine
    from scalerl.rollout.worker.worker import streaming_engine
    from tests.tiny import tiny_model

    cfg = load_config(None, [*CFG, "rollout.engine=vllm"])
    model = tiny_model(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # heads vLLM's CPU build takes
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: None)  # the fake engine below needs no vLLM
    monkeypatch.setitem(sys.modules, "scalerl.rollout.engines.vllm_async", None)  # not importable
    with pytest.raises(UserError, match=r"rollout.partial=true with rollout.engine=vllm needs.*rollout.partial=false"):
        streaming_engine(cfg, model, 0, tmp_path, "vllm")
    calls = []
    fake = types.SimpleNamespace(streaming_vllm_engine=lambda *args: calls.append(args) or "engine")
    monkeypatch.setitem(sys.modules, "scalerl.rollout.engines.vllm_async", fake)
    assert streaming_engine(cfg, model, 7, tmp_path, "vllm") == "engine"
    (given_cfg, model_dir, pad), = calls
    assert given_cfg is cfg and pad == 7 and (tmp_path / "vllm_initial_weights" / "config.json").is_file()
    assert model_dir == str(tmp_path / "vllm_initial_weights")
