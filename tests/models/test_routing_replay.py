"""Rollout routing replay (R3): the built-in engine records each token's routed experts, aligned with the
rollout layout, equal to what a full fp32 forward routes; replaying a model's own routes changes nothing,
replaying other routes uses exactly them (weights from the current router, gradients to ``gate.weight``);
the routes follow the batch through select / trim / pad / rows / concat; the trainer runs with
``actor.router_replay=true`` (single process and DP=2, alike); the layouts it does not cover are refused."""

import copy

import pytest
import torch

from scalerl.core.config import BUILTIN_VOCAB_SIZE, load_config
from scalerl.core.config.tree import ConfigError
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.models.moe import TopKRouter, moe_blocks
from scalerl.models.routing_replay import (
    NO_ROUTE,
    RouteRecorder,
    enable_router_replay,
    forward_routes,
    replaying_routes,
)
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams
from scalerl.trainer.forward_passes import response_logprobs
from tests.spawned_group import run_in_group
from tests.tiny import TINY_MOE, TINY_MOE_VOCAB, tiny_model, tiny_overrides

VOCAB, COMMON = TINY_MOE_VOCAB, TINY_MOE  # the tiny MoE both MoE test files build
CASES = {  # Qwen2-MoE: shared expert, unnormalised top-k, a dense layer; Qwen3-MoE: normalised, every 2nd sparse
    "qwen2_moe": dict(model_type="qwen2_moe", shared_expert_intermediate_size=24, mlp_only_layers=[1],
                      norm_topk_prob=False),
    "qwen3_moe": dict(model_type="qwen3_moe", norm_topk_prob=True, decoder_sparse_step=2, attention_bias=False),
}
STOP = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21, 22, 23, 24]]
LENGTHS = [2, 9, 5, 1, 7]  # each row's response length (its stop token last): rows finish apart, the batch compacts


def _model(case: str, seed: int = 0):
    return build_model(ModelConfig(**COMMON, **CASES[case]), seed=seed)


def _forced_stops(logits, rows, step):
    """Row ``i`` emits the stop token at step ``LENGTHS[i] - 1`` and never before."""
    lengths = torch.tensor(LENGTHS)[rows]
    logits = logits.clone()
    logits[:, STOP] = torch.where(step == lengths - 1, 1e4, -1e4)
    return logits


def _generate(model, record=True, seed=1):
    engine = BuiltinEngine(model, pad_token_id=0, finish_check_every=1, logits_processor=_forced_stops,
                           record_routes=record)
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed,
                                                   stop_token_ids=(STOP,)))


def _batch(out: GenerationOutput) -> RolloutBatch:
    return RolloutBatch.from_generation(out, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS)))


# --- recording -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_recorded_routes_equal_a_full_forwards_on_prompt_and_response(case):
    model = _model(case)
    out = _generate(model)
    plain = _generate(model, record=False)
    assert plain.routed_experts is None
    assert torch.equal(out.response_ids, plain.response_ids)  # recording changes no sample
    assert out.response_mask.sum(-1).tolist() == LENGTHS
    routes = out.routed_experts
    layers = len(moe_blocks(model))
    p = out.prompt_ids.shape[1]
    assert routes.dtype == torch.int32
    assert tuple(routes.shape) == (len(PROMPTS), p + out.response_ids.shape[1], layers, 2)
    batch = _batch(out)
    recorded = routes[..., 0] >= 0  # [B, T, L]
    # recorded: every real prompt token and every response token but the last (never fed back)
    expected = batch.attention_mask.bool().clone()
    expected[torch.arange(len(PROMPTS)), p + torch.tensor(LENGTHS) - 1] = False
    assert torch.equal(recorded, expected[..., None].expand_as(recorded))
    assert bool((routes[~recorded] == NO_ROUTE).all())
    full = forward_routes(model, batch.input_ids, batch.attention_mask)
    assert torch.equal(routes.long().sort(-1).values[recorded], full.long().sort(-1).values[recorded])


# --- replay ----------------------------------------------------------------------------------------------


def test_router_replay_uses_the_recorded_ids_with_the_current_probabilities():
    torch.manual_seed(0)
    for norm in (False, True):
        router = TopKRouter(8, 6, 2, norm_topk_prob=norm)
        x = torch.randn(5, 8)
        own_logits, own_weights, own = router(x)
        replay = torch.tensor([[0, 1], [5, 4], [-1, -1], [2, 3], [1, 5]])
        logits, weights, experts = router(x, replay)
        assert torch.equal(logits, own_logits)  # the aux loss and load metrics read the router's own logits
        assert torch.equal(experts[[0, 1, 3, 4]], replay[[0, 1, 3, 4]])
        assert torch.equal(experts[2], own[2]) and torch.equal(weights[2], own_weights[2])  # no record: own choice
        probs = torch.softmax(own_logits, -1).gather(-1, experts)
        want = probs / probs.sum(-1, keepdim=True) if norm else probs
        assert torch.allclose(weights, want, atol=1e-6)
        weights.sum().backward() if norm is False else (weights * torch.arange(2.0)).sum().backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_replaying_a_models_own_routes_gives_its_logprobs(case):
    model = _model(case)
    batch = _batch(_generate(model))
    plain = response_logprobs(model, batch, 1.0, micro_batch_size=2)
    enable_router_replay(model)
    replayed = response_logprobs(model, batch, 1.0, micro_batch_size=2)
    assert torch.allclose(plain, replayed, atol=1e-5)
    assert all(b.replay_experts is None for b in moe_blocks(model))  # cleared after the pass


def test_replaying_a_perturbed_routers_routes_uses_them_and_trains_the_router():
    model = _model("qwen3_moe")
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for block in moe_blocks(drifted):
            block.gate.weight.add_(torch.randn_like(block.gate.weight) * 2.0, alpha=1.0)
    batch = _batch(_generate(drifted))  # the engine routed with the drifted router
    routes = batch.routed_experts
    recorded = routes[..., 0] >= 0
    own = forward_routes(model, batch.input_ids, batch.attention_mask)
    assert not torch.equal(own.sort(-1).values[recorded], routes.long().sort(-1).values[recorded])
    # the replayed forward routes by the recorded ids where there are some, by its own elsewhere
    with RouteRecorder(model) as rec, replaying_routes(model, routes):
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
        used = rec.take().reshape(routes.shape)
    assert torch.equal(used[recorded], routes[recorded])
    assert torch.equal(used[~recorded], own.to(used.dtype)[~recorded])
    # log-probs differ from routing by the trainer's own router, and the router weights get gradients
    plain = response_logprobs(model, batch, 1.0, micro_batch_size=8)
    enable_router_replay(model)
    replayed = response_logprobs(model, batch, 1.0, micro_batch_size=8)
    assert (plain - replayed).abs().max() > 1e-4
    logits[:, -5:].log_softmax(-1).max(-1).values.sum().backward()
    for block in moe_blocks(model):
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_replay_refuses_routes_of_another_batch():
    model = _model("qwen3_moe")
    batch = _batch(_generate(model))
    with pytest.raises(ValueError, match="not this batch's"), replaying_routes(model, batch.routed_experts):
        model(batch.input_ids[:, 1:])
    with pytest.raises(ValueError, match=r"routes must be \[B, T, 1, 2\]"), \
            replaying_routes(model, batch.routed_experts[..., :1]):
        pass


# --- the routes follow the batch --------------------------------------------------------------------------


def _real_routes(input_ids, attention_mask, routes):
    """Per row, the (token, routes) of its real positions in order: what every re-layout must keep."""
    return [(ids[m.bool()].tolist(), r[m.bool()].tolist()) for ids, m, r in zip(input_ids, attention_mask, routes)]


def test_routes_follow_select_trim_pad_rows_and_concat():
    out = _generate(_model("qwen2_moe"))
    batch = _batch(out)
    want = _real_routes(batch.input_ids, batch.attention_mask, batch.routed_experts)
    picked = batch.select(torch.tensor([3, 0]))
    assert _real_routes(picked.input_ids, picked.attention_mask, picked.routed_experts) == [want[3], want[0]]
    trimmed, left, right = picked.trimmed()
    assert left > 0 and right > 0  # rows 3 and 0 are short: both sides trim
    assert trimmed.routed_experts.shape[1] == trimmed.input_ids.shape[1]
    assert _real_routes(trimmed.input_ids, trimmed.attention_mask, trimmed.routed_experts) == [want[3], want[0]]
    padded = batch.padded_to(batch.prompt_len + 2, batch.response_ids.shape[1] + 3)
    assert padded.routed_experts.shape[1] == padded.input_ids.shape[1]
    assert bool((padded.routed_experts[:, :2] == NO_ROUTE).all() and (padded.routed_experts[:, -3:] == NO_ROUTE).all())
    assert _real_routes(padded.input_ids, padded.attention_mask, padded.routed_experts) == want
    parts = [out.rows(0, 1), out.rows(1, 3), out.rows(3, 5)]
    joined = _batch(GenerationOutput.concat(parts, 0))
    assert torch.equal(joined.routed_experts, batch.routed_experts)
    for part, rows in zip(parts, [(0, 1), (1, 3), (3, 5)]):
        b = RolloutBatch.from_generation(part, torch.zeros(rows[1] - rows[0]), torch.zeros(rows[1] - rows[0]))
        assert _real_routes(b.input_ids, b.attention_mask, b.routed_experts) == want[rows[0]:rows[1]]


# --- the trainer ------------------------------------------------------------------------------------------


def _moe_run_model_dir(path):
    """A tiny Qwen3-MoE over the built-in tokenizer's vocabulary, saved as an HF directory."""
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                      attention_bias=False, tie_word_embeddings=True)
    save_pretrained(build_model(cfg, seed=0), path)
    return path


def _overrides(model_dir, out_dir, *extra):
    directory = model_dir.parent / "reward"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "length_reward.py").write_text("def score(response, ground_truth):\n    return len(response) / 10\n")
    return tiny_overrides(f"model.path={model_dir}", "model.tokenizer=builtin", f"trainer.output_dir={out_dir}",
                          f"data.reward={directory / 'length_reward.py'}:score", "actor.use_kl_loss=true", *extra)


def _train(overrides, steps=2):
    from scalerl.trainer.rl_trainer import RLTrainer

    batches, rows = [], []
    trainer = RLTrainer.from_config(load_config(None, overrides), on_batch=batches.append)
    for step in range(steps):
        trainer.step = step
        rows.append(trainer.train_step())
    return trainer, batches, rows


def test_trainer_replays_the_engines_routes(tmp_path, monkeypatch):
    model_dir = _moe_run_model_dir(tmp_path / "model")
    calls = {"replayed": 0, "training": 0}
    forward = TopKRouter.forward

    def counting(self, x, replay=None):
        if replay is not None:
            calls["replayed"] += 1
            calls["training"] += torch.is_grad_enabled()
        return forward(self, x, replay)

    monkeypatch.setattr(TopKRouter, "forward", counting)
    # bf16 training over fp32 generation: the old log-probs are recomputed (with replay), as is the reference's
    trainer, batches, rows = _train(_overrides(model_dir, tmp_path / "run", "actor.router_replay=true",
                                               "trainer.precision=bf16"))
    assert trainer.engine.record_routes
    assert len(rows) == 2 and all(r["actor/grad_norm"] > 0 and r["actor/grad_norm"] == r["actor/grad_norm"]
                                  for r in rows)
    for batch in batches:
        assert batch.routed_experts is not None
        assert tuple(batch.routed_experts.shape) == (*batch.input_ids.shape, 2, 2)
        assert bool((batch.routed_experts[..., 0][batch.attention_mask == 0] == NO_ROUTE).all())
    assert calls["training"] > 0  # the update's forwards replay (with gradients)
    assert calls["replayed"] > calls["training"]  # ... and so do the old / reference passes (no gradients)
    calls.update(replayed=0, training=0)
    _, batches, _ = _train(_overrides(model_dir, tmp_path / "off", "trainer.precision=bf16"), steps=1)
    assert batches[0].routed_experts is None and calls["replayed"] == 0  # off: nothing recorded or replayed


def _dp_rank(rank, model_dir, out_dir):
    _, _, rows = _train(_overrides(model_dir, out_dir / "dp2", "actor.router_replay=true", "parallel.dp_replicate=2"))
    return rows


def test_data_parallel_replay_equals_the_single_process(tmp_path):
    model_dir = _moe_run_model_dir(tmp_path / "model")
    _, _, single = _train(_overrides(model_dir, tmp_path / "single", "actor.router_replay=true"))
    ranks = run_in_group(_dp_rank, 2, model_dir, tmp_path)
    # (moe/aux_loss is a mean over forwards of a per-forward product: not split-invariant, so not compared)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "moe/expert_load_imbalance"):
        assert [r[key] for r in ranks[0]] == pytest.approx([r[key] for r in single], rel=1e-4, abs=1e-6), key


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, match", [
    ("actor.use_remove_padding=true", "actor.router_replay=true with actor.use_remove_padding=true"),
    ("rollout.engine=vllm", "actor.router_replay=true with rollout.engine=vllm"),
    ("parallel.sp=2", "actor.router_replay=true with parallel.sp=2"),
    ("parallel.pp=2", "actor.router_replay=true with parallel.pp=2"),
    ("parallel.tp=2", "actor.router_replay=true with parallel.tp=2"),
    ("rollout.max_num_seqs=4", "rollout.max_num_seqs=4"),
    ("rollout.placement=standalone", "rollout.placement=standalone"),
])
def test_layouts_replay_does_not_cover_are_refused(override, match):
    load_config(None, [override])  # fine without replay
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["actor.router_replay=true", override])


def test_replay_on_a_dense_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="actor.router_replay=true .* no sparse MoE block"):
        enable_router_replay(tiny_model())
    with pytest.raises(ValueError, match="actor.router_replay=true .* no sparse MoE block.*router_replay=false"):
        _train(tiny_overrides(f"trainer.output_dir={tmp_path}", "actor.router_replay=true"), steps=0)


def test_the_engine_refuses_to_record_under_continuous_batching():
    model = _model("qwen3_moe")
    engine = BuiltinEngine(model, pad_token_id=0, max_num_seqs=2, record_routes=True)
    with pytest.raises(ValueError, match="rollout.max_num_seqs=0"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
