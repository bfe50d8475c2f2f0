"""The memory model against the bytes a built model really holds: parameters, gradients and AdamW state of
the tiny model, the KV cache the engine allocates, and the first phase over a small cap with its fix."""

from __future__ import annotations

import torch

from scalerl.bench.cost_model.step_traffic import Layout
from scalerl.models.kv_cache import KVCache
from scalerl.plan.cli import find_fix, first_unfit
from scalerl.plan.memory import (
    GIB,
    PlanSetup,
    kv_cache_bytes,
    lora_param_count,
    persistent_parts,
    phase_parts,
    total,
)
from tests.tiny import tiny_model, tiny_model_config


def _setup(**changes) -> PlanSetup:
    return PlanSetup(**{"model": tiny_model_config(), "layout": Layout(), "rows": 16, "prompt_width": 16,
                        "new_tokens": 8, "micro_rows": 4, "mini_rows": 16, **changes})


def test_parameters_gradients_and_adamw_state_are_the_built_models_bytes():
    model = tiny_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(3, 64, (2, 6))
    model(ids, attention_mask=torch.ones_like(ids)).float().logsumexp(-1).mean().backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                  for k, t in state.items() if k in ("exp_avg", "exp_avg_sq"))
    setup = _setup(model=model.config)
    parts = persistent_parts(setup)
    assert parts["parameters"] == params
    assert parts["optimizer"] == moments
    assert phase_parts(setup)["update"]["gradients"] == grads
    sharded = persistent_parts(setup.replace(layout=Layout(dp_shard=2)))  # FSDP over 2: half of each
    assert sharded["parameters"] == params / 2 and sharded["optimizer"] == moments / 2
    # one layer's gradients in flight while micro-batches accumulate (4 of 16 rows here), none with a single
    # micro-batch; the layer's share of the parameters outside the embedding and the head
    cfg = model.config
    layer = (sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size
             * (1 if cfg.tie_word_embeddings else 2)) / cfg.num_hidden_layers
    assert phase_parts(setup)["update"]["gradient_temporaries"] == layer * 4
    assert phase_parts(setup.replace(micro_rows=16))["update"]["gradient_temporaries"] == 0


def test_ddp_keeps_a_bucket_copy_of_the_gradients_and_lora_trains_only_adapters():
    cfg = tiny_model_config()
    ddp = persistent_parts(_setup(layout=Layout(dp_replicate=2)))
    assert ddp["ddp_buckets"] == ddp["parameters"]
    adapters = lora_param_count(cfg, 4, ("all-linear",))
    h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    assert adapters == cfg.num_hidden_layers * 4 * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)
    lora = persistent_parts(_setup(lora_rank=4))
    assert lora["optimizer"] == 2 * adapters * 4


def test_kv_cache_formula_is_what_the_engine_allocates():
    cfg = tiny_model_config()
    rows, length = 6, 40
    cache = KVCache(cfg.num_hidden_layers, rows, length)
    cache.allocate(cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    allocated = cache.kv.numel() * cache.kv.element_size()
    # batch x length x layers x kv heads x head dim x 2 x bytes
    assert kv_cache_bytes(cfg, rows, length, 4) == allocated
    assert kv_cache_bytes(cfg, rows, length, 4) == rows * length * cfg.num_hidden_layers * \
        cfg.num_key_value_heads * cfg.head_dim * 2 * 4
    setup = _setup(prompt_width=32, new_tokens=8, rows=6)
    assert phase_parts(setup)["generation"]["kv_cache"] == allocated


def test_activation_checkpointing_saves_memory_and_the_first_phase_over_a_cap_gets_a_fix():
    setup = _setup(micro_rows=16, prompt_width=256, new_tokens=64, rows=16)
    update = total(phase_parts(setup)["update"])
    assert total(phase_parts(setup.replace(activation_checkpointing=True))["update"]) < update
    others = max(total(p) for name, p in phase_parts(setup).items() if name != "update")
    cap = (others + update) / 2  # generation fits, the update does not
    phase, peak = first_unfit(setup, cap)
    assert phase == "update" and peak == update
    override, why = find_fix(setup, cap, phase)
    assert override == "model.activation_checkpointing=true" and why
    assert first_unfit(setup.replace(activation_checkpointing=True), cap) is None


def test_a_cap_below_the_weights_needs_fsdp():
    setup = _setup(layout=Layout(dp_replicate=4), model=tiny_model_config(hidden_size=128, intermediate_size=512,
                                                                           num_hidden_layers=4),
                   rows=1, micro_rows=1, prompt_width=4, new_tokens=4)  # the weights dominate
    state = total(persistent_parts(setup))
    # not even the weights and AdamW state fit one rank; FSDP gathers the model to generate (twice: the
    # all-gather's output and the parameters copied out of it), which over 2 ranks is still too much
    cap = state * 0.6
    phase, _ = first_unfit(setup, cap)
    assert phase == "generation"
    override, _ = find_fix(setup, cap, phase)
    assert override.startswith("parallel.dp_shard=4") and cap < GIB


def test_batches_are_padded_to_the_longest_prompt_of_the_data_but_pipeline_stages_to_the_cap():
    cfg = tiny_model_config()
    setup = _setup(prompt_width=64, longest_prompt=14, new_tokens=8, rows=6, micro_rows=2)
    # the engine's cache is rows x (longest prompt + new tokens): 6 x 22 positions, not 6 x 72
    assert phase_parts(setup)["generation"]["kv_cache"] == kv_cache_bytes(cfg, 6, 14 + 8, 4)
    assert setup.train_width == 22 and setup.micro_tokens == 2 * 22
    piped = _setup(prompt_width=64, longest_prompt=14, new_tokens=8, rows=6, micro_rows=2, layout=Layout(pp=2))
    assert piped.train_width == 64 + 8  # the stages pad every batch to data.max_prompt_length + new tokens
    assert _setup(prompt_width=10, longest_prompt=14).padded_prompt == 10  # never past the cap


def test_the_weight_sync_buckets_hold_at_most_the_model():
    from scalerl.plan.memory import MIB, policy_counts, sync_buffer_bytes, worker_parts

    small = _setup(standalone=True, layout=Layout(rollout_workers=1), bucket_bytes=64 * MIB, rollout_bytes=4)
    model_bytes = policy_counts(small)[0] * 4
    assert model_bytes < 64 * MIB
    # two buckets (one filling, one in flight), each the whole tiny model rather than 64 MiB
    assert sync_buffer_bytes(small) == 2 * model_bytes
    assert phase_parts(small)["weight_sync"]["weight_sync_buckets"] == 2 * model_bytes
    assert worker_parts(small)["weight_sync_buckets"] == 2 * model_bytes
    tight = small.replace(bucket_bytes=model_bytes // 4)
    assert sync_buffer_bytes(tight) == 2 * (model_bytes // 4)


def test_the_decode_layout_is_what_the_built_in_engine_copies():
    from scalerl.models.decode_model import DecodeModel
    from scalerl.plan.memory import decode_layout_bytes

    model = tiny_model()
    cfg = model.config
    setup = _setup(model=cfg)
    # per layer q/k/v, o, gate/up, down, and the LM head, once more in the compute dtype (float32 here)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    by_hand = (cfg.num_hidden_layers * (cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
                                        + 3 * cfg.intermediate_size * cfg.hidden_size)
               + cfg.vocab_size * cfg.hidden_size) * 4
    assert decode_layout_bytes(setup) == by_hand == DecodeModel(model).weight_bytes
    parts = phase_parts(setup)
    assert parts["update"]["decode_layout"] == by_hand  # kept from the first generation on
    # laid out again in place (the old copy goes first): the sync holds the layout once, and one fused matrix
    # (here gate/up, 2 x intermediate rows) concatenated before its layout is made
    assert sum(parts["weight_sync"].values()) == sum(persistent_parts(setup).values()) + parts["weight_sync"][
        "layout_rebuild"]
    assert parts["weight_sync"]["layout_rebuild"] == 2 * cfg.intermediate_size * cfg.hidden_size * 4
    layout = DecodeModel(model)
    first = layout.layers[0].qkv.weight
    layout.refresh()
    assert layout.layers[0].qkv.weight is not first and not layout.is_stale()
    # sharded or standalone: generation runs the model's own forward (workers hold their own copy)
    assert decode_layout_bytes(_setup(model=cfg, layout=Layout(dp_shard=2))) == 0
    assert decode_layout_bytes(_setup(model=cfg, layout=Layout(tp=2))) == 0
    assert decode_layout_bytes(_setup(model=cfg, standalone=True, layout=Layout(rollout_workers=1))) == 0


def test_evaluation_decodes_at_most_max_num_seqs_rows_at_once_as_generation_does():
    # a long-context projection's evaluation (its validation rows at up to 256 per call) once needed the KV cache
    # of 256 rows where the same engine decodes rollout.max_num_seqs at a time
    setup = _setup(eval_rows=64, prompt_width=64, new_tokens=64)
    capped = setup.replace(max_num_seqs=4)
    cfg = tiny_model_config()
    assert phase_parts(setup)["evaluation"]["kv_cache"] == kv_cache_bytes(cfg, 64, 128, 4)
    assert phase_parts(capped)["evaluation"]["kv_cache"] == kv_cache_bytes(cfg, 4, 128, 4)
    assert phase_parts(capped)["generation"]["kv_cache"] == kv_cache_bytes(cfg, 4, 128, 4)
