"""Qwen2-MoE and Qwen3-MoE: logit parity with transformers both ways (per-expert and fused expert layouts),
the load-balancing loss against transformers', engine generation, bad checkpoints, training with the
auxiliary loss and its metrics (single process and DDP at world 2), refused layouts and the FLOPs count."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from scalerl.core.config import BUILTIN_VOCAB_SIZE
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import (
    CheckpointFormatError,
    from_pretrained,
    save_pretrained,
)
from scalerl.models.moe import (
    RouterAuxLoss,
    SparseMoeBlock,
    expert_capacity,
    load_balancing_loss,
    moe_blocks,
    routed_expert_outputs,
    set_capacity_factor,
)
from scalerl.parallel.mesh import LayoutError, ParallelDims
from scalerl.perf.flops import decoder_param_count, matmul_param_count
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.spawned_group import run_in_group
from tests.tiny import TINY_MOE, TINY_MOE_VOCAB, tiny_overrides

VOCAB, COMMON = TINY_MOE_VOCAB, TINY_MOE  # the tiny MoE both MoE test files build
# (architecture, its own settings): Qwen2-MoE with a shared expert, unnormalised top-k and one dense layer;
# Qwen3-MoE with q/k norms, normalised top-k and every second layer sparse; top-1 routing.
CASES = {
    "qwen2_moe": ("qwen2_moe", dict(shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen3_moe_top1_tied": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True,
                                              head_dim=16)),  # q width 64 != hidden 32, as in Qwen3-30B-A3B
}


def _hf_model(case: str):
    arch, extra = CASES[case]
    torch.manual_seed(0)
    if arch == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**COMMON, **extra}))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**COMMON, **extra}))
    with torch.no_grad():  # random biases and norm weights (HF initialises them to 0 / 1), so parity tests them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _batch(padded: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # left padding of different lengths, as in batched prompts
        mask[0, :4] = 0
        mask[2, :7] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _max_logit_diff(hf, ours, padded):
    ids, mask = _batch(padded)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
    return (ref - got)[mask.bool()].abs().max().item()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_scalerl_logits_match(tmp_path, case, padded):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)  # transformers 5 writes the per-expert layout of published checkpoints
    assert any(k.endswith(".mlp.experts.3.up_proj.weight") for k in load_file(tmp_path / "model.safetensors"))
    ours = from_pretrained(tmp_path).eval()
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers]
    assert sparse == [hf.model.layers[i].mlp.__class__.__name__.endswith("SparseMoeBlock") for i in range(3)]
    assert _max_logit_diff(hf, ours, padded) <= 1e-4


def test_fused_expert_layout_loads(tmp_path):
    """A directory holding transformers 5's in-memory tensors (``experts.gate_up_proj`` / ``down_proj``)."""
    hf = _hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert _max_logit_diff(hf, from_pretrained(tmp_path).eval(), padded=True) <= 1e-4


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe"])
def test_scalerl_to_hf_logits_match(tmp_path, case):
    ours = from_pretrained(_saved(tmp_path / "src", case)).eval()
    with torch.no_grad():  # move away from the HF weights, so the round trip carries our own
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=40_000)  # sharded, with an index
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(hf).__name__ == {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[case]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for padded in (False, True):
        assert _max_logit_diff(hf.eval(), ours, padded) <= 1e-4
    assert from_pretrained(tmp_path / "out").config == ours.config


def _saved(path, case):
    _hf_model(case).save_pretrained(path)
    return path


def test_aux_loss_equals_transformers(tmp_path):
    hf = _hf_model("qwen2_moe")
    ours = from_pretrained(_saved(tmp_path, "qwen2_moe")).eval()
    ids, mask = _batch(padded=True)
    for attention_mask in (mask, None):
        with torch.no_grad():
            ref = hf(ids, attention_mask=attention_mask, output_router_logits=True).aux_loss
        ours(ids, attention_mask=attention_mask)
        logits = [b.last_router_logits for b in moe_blocks(ours)]
        assert len(logits) == 2
        got = load_balancing_loss(logits, 4, 2, attention_mask)
        assert abs(got.item() - ref.item()) <= 1e-6 and got.item() > 1.0


def test_router_aux_loss_trains_only_when_enabled(tmp_path):
    model = from_pretrained(_saved(tmp_path, "qwen3_moe"))
    ids, mask = _batch(padded=True)
    assert RouterAuxLoss.of(build_model(ModelConfig(vocab_size=VOCAB))) is None  # dense: no hook
    off = RouterAuxLoss.of(model)
    model(ids, attention_mask=mask)
    term = off.loss_term(mask, 2)
    assert off.coef == 0.0 and not term.requires_grad and term.item() == 0.0
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.5
    on = RouterAuxLoss.of(model)
    model(ids, attention_mask=mask)
    term = on.loss_term(mask, 2)
    aux = load_balancing_loss([b.last_router_logits for b in moe_blocks(model)], 4, 2, mask)
    assert torch.allclose(term, 0.25 * aux)
    term.backward()
    router = model.layers[1].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    assert model.layers[1].mlp.experts[0].up_proj.weight.grad is None  # the aux loss reaches only routers
    metrics = on.metrics()
    assert metrics["moe/aux_loss"] == pytest.approx(aux.item(), rel=1e-6)
    counts = torch.zeros(4)
    counts.scatter_add_(0, torch.topk(model.layers[1].mlp.last_router_logits, 2).indices.reshape(-1),
                        mask.reshape(-1).float().repeat_interleave(2))
    assert metrics["moe/expert_load_imbalance"] == pytest.approx((counts.max() / counts.mean()).item(), rel=1e-6)
    assert on.metrics() == {}  # reset after reading


def test_aux_loss_gradient_is_the_same_under_activation_checkpointing(tmp_path):
    """The router logits are read from inside checkpointed layers: their gradient must survive recompute."""
    import copy

    from scalerl.parallel.activation_checkpointing import apply_activation_checkpointing

    plain = from_pretrained(_saved(tmp_path, "qwen2_moe"))
    plain.config.output_router_logits = True
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed)
    ids, mask = _batch(padded=True)
    grads = []
    for model in (plain, checkpointed):
        aux = RouterAuxLoss.of(model)
        loss = model(ids, attention_mask=mask)[mask.bool()].logsumexp(-1).mean() + aux.loss_term(mask, 1) * 100
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "mlp" in n})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


def test_engine_greedy_equals_transformers_generate(tmp_path):
    hf = _hf_model("qwen2_moe")
    ours = from_pretrained(_saved(tmp_path, "qwen2_moe")).eval()
    prompts = [[5, 17, 33, 9, 41], [7, 8, 60]]
    out = BuiltinEngine(ours, pad_token_id=0).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    for row, prompt in enumerate(prompts):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.response_ids[row].tolist() == ref[0, len(prompt):].tolist()


def _write_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_expert_tensor_is_named(tmp_path):
    _saved(tmp_path, "qwen2_moe")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.2.mlp.experts.3.down_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight"):
        from_pretrained(tmp_path)


def test_mismatched_router_is_named(tmp_path):
    _saved(tmp_path, "qwen3_moe")
    _write_config(tmp_path, num_local_experts=3, num_experts_per_tok=2)  # the router holds 4 rows
    with pytest.raises(CheckpointFormatError, match=r"mlp\.gate\.weight .*\(4, 32\).*\(3, 32\)"):
        from_pretrained(tmp_path)


def test_mismatched_fused_experts_are_named(tmp_path):
    hf = _hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.0.mlp.experts.down_proj"] = state["model.layers.0.mlp.experts.down_proj"][:, :, :8].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.0\.mlp\.experts\.down_proj .*moe_intermediate_size=16"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("changes, field", [
    ({"num_experts": None, "num_local_experts": None}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"moe_intermediate_size": "16"}, "moe_intermediate_size"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
])
def test_bad_moe_config_field_is_named(tmp_path, changes, field):
    _saved(tmp_path, "qwen2_moe")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointFormatError, match=field):
        from_pretrained(tmp_path)


def test_tensor_and_pipeline_parallel_are_refused():
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, attention_bias=False)
    for dims in (ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=2), ParallelDims(pp=2, dp_replicate=1, dp_shard=1, tp=1)):
        with pytest.raises(LayoutError, match="MoE model .*parallel.tp=.* parallel.pp="):
            dims.check_model(cfg)
    ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=1).check_model(cfg)


def test_flops_count_active_parameters(tmp_path):
    hf = _hf_model("qwen2_moe")
    cfg = from_pretrained(_saved(tmp_path, "qwen2_moe")).config
    assert decoder_param_count(cfg) == sum(p.numel() for p in hf.parameters())
    h, layers = 32, 3
    attention = h * 32 + 2 * h * 16 + 32 * h  # q (4 heads of 8), k and v (2 kv heads of 8), o
    dense = 3 * h * 48
    sparse = h * 4 + 2 * 3 * h * 16 + 3 * h * 24 + h  # router, top-2 experts, shared expert and its gate
    assert matmul_param_count(cfg) == layers * attention + dense + 2 * sparse + h * VOCAB


# --- training: the aux loss in the RL objective, its metrics, DDP at world 2 --------------------------------


def _moe_run_model_dir(path, aux: bool):
    """A tiny Qwen2-MoE over the built-in tokenizer's vocabulary, saved as an HF directory."""
    cfg = ModelConfig(model_type="qwen2_moe", vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, output_router_logits=aux, router_aux_loss_coef=0.05,
                      tie_word_embeddings=True)
    save_pretrained(build_model(cfg, seed=0), path)
    return path


def _length_reward(directory):
    """A reward that varies within a group for an untrained model (the built-in task's exact answers would
    leave every advantage at zero): the policy gradient is not zero."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "length_reward.py").write_text("def score(response, ground_truth):\n    return len(response) / 10\n")
    return f"data.reward={directory / 'length_reward.py'}:score"


def _train_metrics(out_dir, model_dir, *extra):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    config = load_config(None, tiny_overrides(f"model.path={model_dir}", "model.tokenizer=builtin",
                                              f"trainer.output_dir={out_dir}", _length_reward(model_dir), *extra))
    trainer = RLTrainer.from_config(config)
    rows = []
    for step in range(2):
        trainer.step = step
        rows.append(trainer.train_step())
    return rows


def test_rl_step_adds_the_aux_loss_and_logs_router_metrics(tmp_path):
    rows = _train_metrics(tmp_path / "on", _moe_run_model_dir(tmp_path / "m_on", aux=True),
                          "model.activation_checkpointing=true")
    for row in rows:
        assert row["moe/aux_loss"] >= 1.0 - 1e-6  # E * sum f*P is at least 1 (balanced) for top-k routing
        assert row["moe/expert_load_imbalance"] >= 1.0
        assert row["actor/grad_norm"] > 0
    off = _train_metrics(tmp_path / "off", _moe_run_model_dir(tmp_path / "m_off", aux=False))
    assert "moe/aux_loss" in off[0]
    # The same weights and rollouts: the first update's gradient differs only by the aux loss term.
    assert off[0]["actor/grad_norm"] != pytest.approx(rows[0]["actor/grad_norm"], rel=1e-9, abs=0)


def test_sft_adds_the_aux_loss_and_logs_router_metrics(tmp_path):
    from scalerl.core.config import load_config
    from scalerl.trainer.sft_trainer import train_sft

    model_dir = _moe_run_model_dir(tmp_path / "model", aux=True)
    summary = train_sft(load_config(None, tiny_overrides(f"model.path={model_dir}", "model.tokenizer=builtin",
                                                         f"trainer.output_dir={tmp_path / 'run'}")))
    rows = [json.loads(line) for line in (tmp_path / "run" / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "sft/loss" in r]
    assert len(steps) == 3 and all(r["moe/aux_loss"] >= 1.0 - 1e-6 and r["moe/expert_load_imbalance"] >= 1.0
                                   for r in steps)
    assert from_pretrained(summary["model_dir"]).config.num_experts == 4  # exported as a MoE directory


def _data_parallel_rank(rank, model_dir, out_dir):
    return {layout: _train_metrics(out_dir / layout, model_dir, f"parallel.{layout}=2")
            for layout in ("dp_replicate", "dp_shard")}


def test_ddp_and_fsdp_at_world_2_train_a_moe_model_alike(tmp_path):
    """DDP and per-layer FSDP2 (the MoE layer is a decoder layer like any other) train the same steps: both
    average each rank's loss + aux gradient, so their losses and gradient norms agree."""
    model_dir = _moe_run_model_dir(tmp_path / "model", aux=True)
    ranks = run_in_group(_data_parallel_rank, 2, model_dir, tmp_path / "run")
    for by_layout in ranks:
        for rows in by_layout.values():
            assert len(rows) == 2
            assert all(r["moe/aux_loss"] >= 1.0 - 1e-6 and r["actor/grad_norm"] > 0 for r in rows)
    ddp, fsdp = ranks[0]["dp_replicate"], ranks[0]["dp_shard"]
    for key in ("actor/pg_loss", "actor/grad_norm", "moe/aux_loss", "moe/expert_load_imbalance"):
        assert [r[key] for r in ddp] == pytest.approx([r[key] for r in fsdp], rel=1e-4, abs=1e-6), key
    # reduced over the ranks: both report the same step values
    assert ranks[0]["dp_shard"][1]["moe/aux_loss"] == ranks[1]["dp_shard"][1]["moe/aux_loss"]


# --- capacity factor: at most ceil(factor x tokens x top_k / E) assignments per expert, the heaviest kept ---


def test_capacity_keeps_each_experts_heaviest_assignments():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(2))
    flat = torch.randn(6, 4)
    # every token's top-1 is expert 0 except token 4; token 1 is padding
    chosen = torch.tensor([[0], [0], [0], [0], [1], [0]])
    weights = torch.tensor([[0.2], [1.0], [0.5], [0.9], [1.0], [0.5]])
    real = torch.tensor([True, False, True, True, True, True])
    assert expert_capacity(5, 1, 2, 1.0) == 3  # ceil(1.0 x 5 real tokens x top-1 / 2 experts)
    out, dropped = routed_expert_outputs(flat, weights, chosen, experts, 1.0, real)
    assert dropped == 1  # expert 0 got tokens 0, 2, 3, 5: the lightest (0, weight 0.2) is dropped
    for row in (2, 3, 5):  # (2 and 5 tie at 0.5: both fit)
        assert torch.allclose(out[row], experts[0](flat[row]) * weights[row])
    assert torch.allclose(out[4], experts[1](flat[4]))
    assert out[0].abs().max() == 0 and out[1].abs().max() == 0  # dropped, and padding: no expert output
    # ties at the boundary all drop, whatever the rows' order: weights 0.9, 0.5, 0.5, 0.5 for 3 slots keep one
    tied_weights = torch.tensor([[0.5], [1.0], [0.9], [0.5], [1.0], [0.5]])
    tied, dropped = routed_expert_outputs(flat, tied_weights, chosen, experts, 1.0, real)
    assert dropped == 3 and tied[2].abs().max() > 0 and all(tied[r].abs().max() == 0 for r in (0, 3, 5))
    unlimited, none = routed_expert_outputs(flat, weights, chosen, experts)
    assert none == 0 and torch.allclose(unlimited[0], experts[0](flat[0]) * 0.2) and unlimited[1].abs().max() > 0


def test_capacity_factor_applies_to_training_forwards_and_is_counted(tmp_path):
    model = from_pretrained(_saved(tmp_path, "qwen2_moe"))
    ids, mask = _batch(padded=True)
    model.train()
    free = model(ids, attention_mask=mask)
    set_capacity_factor(model, 0.5)
    aux = RouterAuxLoss.of(model)
    limited = model(ids, attention_mask=mask)
    aux.loss_term(mask, 1)
    metrics = aux.metrics()
    real = int(mask.sum())
    expected = 0
    for block in moe_blocks(model):  # the drops from the router's choices of the real tokens
        chosen = torch.topk(block.last_router_logits.detach()[mask.reshape(-1).bool()], 2, dim=-1).indices
        cap = expert_capacity(real, 2, 4, 0.5)
        expected += sum(max(0, int((chosen == e).sum()) - cap) for e in range(4))
    assert metrics["moe/dropped_tokens"] == expected > 0
    assert metrics["moe/dropped_token_fraction"] == pytest.approx(expected / (real * 2 * 2))
    assert (free - limited)[mask.bool()].abs().max() > 1e-4  # dropped experts change the logits
    model.eval()  # generation and log-prob passes route every token
    assert torch.equal(model(ids, attention_mask=mask)[mask.bool()], free[mask.bool()])
    set_capacity_factor(model, 1e6)  # (factors replace each other) a bound no expert reaches
    model.train()
    assert torch.allclose(model(ids, attention_mask=mask)[mask.bool()], free[mask.bool()], atol=1e-6)
    aux.loss_term(mask, 1)
    assert aux.metrics()["moe/dropped_tokens"] == 0
    # a deep copy (PPO's critic backbone) marks its own blocks' real rows, not the original's
    import copy

    for block in moe_blocks(model):
        block.last_router_logits = None  # (a graph's tensors cannot be deep-copied; a critic is copied before any)
    critic = copy.deepcopy(model)
    for block in moe_blocks(model):
        block.token_mask = None
    critic(ids[:1], attention_mask=mask[:1])
    assert all(b.token_mask is None for b in moe_blocks(model))
    assert all(torch.equal(b.token_mask, mask[0].bool()) for b in moe_blocks(critic))


def test_capacity_factor_on_a_dense_model_is_refused():
    from scalerl.core.config import ConfigError, ModelSection
    from scalerl.models.load import load_model_and_tokenizer

    with pytest.raises(ConfigError, match="model.moe_capacity_factor=1.0 applies to MoE models"):
        load_model_and_tokenizer(ModelSection(moe_capacity_factor=1.0), None, torch.device("cpu"), 0)


# --- expert parallelism: experts over the DP ranks, tokens by all-to-all, against one process ---------------


def _expert_parallel_rank(rank, model_dir):
    import copy

    from scalerl.core.config import ParallelSection
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.expert_parallel import apply_expert_parallel

    ctx = init_distributed(ParallelSection(dp_replicate=2), torch.device("cpu"))
    reference = from_pretrained(model_dir)
    reference.config.output_router_logits = True
    sharded = copy.deepcopy(reference)
    assert len(apply_expert_parallel(sharded, ctx)) == 2 * 2 * 3  # 2 sparse layers x 2 experts x 3 weights
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    probe = torch.randn(4, 10, VOCAB, generator=torch.Generator().manual_seed(6))
    mine = slice(2 * rank, 2 * rank + 2)  # each rank's half of the batch
    # one process on the whole batch
    ref_logits = reference(ids, attention_mask=mask)
    (ref_logits * probe).sum().backward()
    # expert parallel: each rank its half; tokens of both ranks reach each expert through the all-to-all
    ctx.comm.reset()
    logits = sharded(ids[mine], attention_mask=mask[mine])
    loss = (logits * probe[mine]).sum()
    loss.backward()
    sent = ctx.comm.step_metrics()["comm/bytes/expert"]
    total = ctx.all_reduce(loss.detach().clone())
    ref_grads = dict(reference.named_parameters())
    worst = 0.0
    names = set()
    for name, p in sharded.named_parameters():
        # experts: already summed over the ranks' tokens, then scaled by 1/2 for DDP's mean; others: summed here
        grad = p.grad * 2 if ".experts." in name else ctx.all_reduce(p.grad.clone())
        ref = ref_grads[name].grad  # relative to the tensor's scale: sums over ranks are ordered differently
        worst = max(worst, ((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item())
        names.add(name)
    expected = _expected_expert_bytes(reference, ranks=2, rows_per_rank=20, hidden=COMMON["hidden_size"])
    result = dict(logit_diff=(logits - ref_logits[mine]).detach().abs().max().item(),
                  loss_diff=abs(total.item() - (ref_logits * probe).sum().item()), grad_diff=worst, sent=sent,
                  expected_sent=expected,
                  experts=sorted({int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}))
    result["capacity"] = _capacity_factor_case(ctx, reference, sharded, ids, mask, probe, mine)
    return result


def _expected_expert_bytes(model, ranks: int, rows_per_rank: int, hidden: int) -> float:
    """What a rank sends for one forward + backward under expert parallelism, from the routing of the
    one-process forward just run (its rows are the ranks' rows, rank by rank): per sparse layer the counts
    all-gather of ``[1, E + 1]`` int64 (payload ``P (E + 1) 8``), then two all-to-alls forward and two backward of
    ``P x chunk`` fp32 rows, ``chunk`` the largest share one rank sends to another; each moves ``(P-1)/P`` of its
    payload."""
    total = 0.0
    for block in moe_blocks(model):
        chosen = torch.topk(block.last_router_logits.detach(), block.top_k, dim=-1).indices
        per_rank = block.num_experts // ranks
        chunk = max(int(((chosen[r * rows_per_rank:(r + 1) * rows_per_rank] // per_rank) == d).sum())
                    for r in range(ranks) for d in range(ranks))
        total += (ranks - 1) / ranks * ranks * (block.num_experts + 1) * 8
        total += 4 * (ranks - 1) / ranks * ranks * chunk * hidden * 4
    return total


def _capacity_factor_case(ctx, reference, sharded, ids, mask, probe, mine, factor=0.75):
    """The same forward + backward with ``model.moe_capacity_factor`` dropping assignments: the drops, the
    logits and the gradients of one process and of the expert-parallel ranks agree."""
    from scalerl.models.moe import set_capacity_factor

    for model in (reference, sharded):
        model.train()
        model.zero_grad(set_to_none=True)
        set_capacity_factor(model, factor)
    ref_aux, ep_aux = RouterAuxLoss.of(reference), RouterAuxLoss.of(sharded)
    ref_logits = reference(ids, attention_mask=mask)
    ref_aux.loss_term(mask, 1)
    (ref_logits * probe).sum().backward()
    logits = sharded(ids[mine], attention_mask=mask[mine])
    ep_aux.loss_term(mask[mine], 1)
    (logits * probe[mine]).sum().backward()
    ref_grads = dict(reference.named_parameters())
    worst = 0.0
    for name, p in sharded.named_parameters():
        grad = p.grad * 2 if ".experts." in name else ctx.all_reduce(p.grad.clone())
        ref = ref_grads[name].grad
        worst = max(worst, ((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item())
    return dict(one=ref_aux.metrics(), ep=ep_aux.metrics(ctx.all_reduce), grad_diff=worst,
                logit_diff=(logits - ref_logits[mine]).detach()[mask[mine].bool()].abs().max().item())


def test_expert_parallel_equals_one_process(tmp_path):
    model_dir = _saved(tmp_path, "qwen2_moe")
    ranks = run_in_group(_expert_parallel_rank, 2, model_dir)
    assert [r["experts"] for r in ranks] == [[0, 1], [2, 3]]  # each rank holds its half, by global name
    for r in ranks:
        assert r["logit_diff"] <= 1e-5 and r["loss_diff"] <= 1e-3 and r["grad_diff"] <= 1e-5, r  # grad_diff: relative
        # the counts gather and the token all-to-alls (forward and backward), counted as expert traffic
        assert r["sent"] == pytest.approx(r["expected_sent"], rel=1e-12), r
        cap = r["capacity"]
        # 37 real tokens x top-2 over 4 experts at factor 0.75: 14 slots each, so some assignments are dropped
        assert cap["one"]["moe/dropped_tokens"] > 0, cap
        assert cap["ep"]["moe/dropped_tokens"] == cap["one"]["moe/dropped_tokens"], cap
        assert cap["ep"]["moe/dropped_token_fraction"] == pytest.approx(cap["one"]["moe/dropped_token_fraction"])
        assert cap["one"]["moe/dropped_token_fraction"] == pytest.approx(cap["one"]["moe/dropped_tokens"] / (37 * 2 * 2))
        assert cap["logit_diff"] <= 1e-5 and cap["grad_diff"] <= 1e-5, cap


def _ep_run(rank, model_dir, out_dir, layouts):
    from scalerl.verify import run_kind

    for name, extra in layouts.items():
        run_kind("grpo", tiny_overrides(f"model.path={model_dir}", "model.tokenizer=builtin", "trainer.total_steps=2",
                                        "actor.lr=1e-3", _length_reward(model_dir), *extra), out_dir / name)


def test_expert_parallel_training_equals_one_process(tmp_path):
    """parallel.ep=2 over two DDP ranks: the same losses, gradient norms and exported weights as one process
    (the aux loss off: with it on each rank's aux loss is over its own tokens, as under plain DDP)."""
    from scalerl.verify import TOLERANCE, max_weight_diff

    model_dir = _moe_run_model_dir(tmp_path / "model", aux=False)
    _ep_run(0, model_dir, tmp_path, {"single": []})
    run_in_group(_ep_run, 2, model_dir, tmp_path, {"ep2": ["parallel.dp_replicate=2", "parallel.ep=2"]})
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("single", "ep2")}
    steps = {name: [r for r in rs if r.get("step", 0) > 0 and "actor/grad_norm" in r] for name, rs in rows.items()}
    assert len(steps["ep2"]) == len(steps["single"]) == 2
    for a, b in zip(steps["single"], steps["ep2"]):
        # (moe/aux_loss is a mean over forwards, each over its own rank's tokens: not comparable)
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "moe/expert_load_imbalance"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["comm/bytes/expert"] > 0 and a.get("comm/bytes/expert", 0) == 0
    # the export gathered every rank's experts: all four of each layer, equal to the single process's
    exported = load_file(tmp_path / "ep2" / "final" / "model.safetensors")
    assert sum(".mlp.experts." in k and k.endswith("up_proj.weight") for k in exported) == 2 * 4
    assert max_weight_diff(tmp_path / "single" / "final", tmp_path / "ep2" / "final") <= TOLERANCE
    assert max_weight_diff(model_dir, tmp_path / "ep2" / "final") > 50 * TOLERANCE  # it did train


def test_expert_parallel_layouts_that_cannot_work_are_refused(tmp_path):
    from scalerl.core.config import ConfigError, ParallelSection, load_config

    with pytest.raises(LayoutError, match="parallel.ep=2 .*parallel.dp_replicate=2"):
        ParallelDims.from_config(ParallelSection(dp_replicate=4, ep=2), 4)  # under FSDP2 it composes (tests/parallel)
    with pytest.raises(LayoutError, match="parallel.ep=4"):
        ParallelDims.from_config(ParallelSection(dp_replicate=2, ep=4), 2)
    assert ParallelDims.from_config(ParallelSection(dp_replicate=-1, ep=2), 2).ep == 2
    dense = ModelConfig(vocab_size=VOCAB)
    with pytest.raises(LayoutError, match="parallel.ep=2 needs a MoE model"):
        ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1, ep=2).check_model(dense)
    with pytest.raises(ConfigError, match="parallel.ep=2 .*built-in model is dense"):
        load_config(None, tiny_overrides("parallel.ep=2"))
    with pytest.raises(ConfigError, match="rollout.placement=standalone"):
        load_config(None, tiny_overrides("parallel.ep=2", f"model.path={tmp_path}", "rollout.placement=standalone"))


def _ep_resume_rank(rank, model_dir, out_dir):
    from scalerl.verify import run_kind

    common = tiny_overrides(f"model.path={model_dir}", "model.tokenizer=builtin", "actor.lr=1e-3",
                            _length_reward(model_dir), "parallel.dp_replicate=2", "parallel.ep=2")
    run_kind("grpo", [*common, "trainer.total_steps=2"], out_dir / "straight")
    run_kind("grpo", [*common, "trainer.total_steps=1"], out_dir / "resumed")
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer.from_config(load_config(None, [*common, "trainer.total_steps=2", "trainer.resume=auto",
                                                       f"trainer.output_dir={out_dir / 'resumed'}"]))
    start = trainer.step  # 1: the checkpoint of the first call was loaded
    return start, trainer.fit()["final_model"]


def test_expert_parallel_checkpoint_resumes(tmp_path):
    """Each rank's checkpoint holds its own experts (per-rank keys); resuming at the same layout continues
    exactly where the run stopped."""
    from scalerl.verify import TOLERANCE, max_weight_diff

    model_dir = _moe_run_model_dir(tmp_path / "model", aux=True)
    start, final = run_in_group(_ep_resume_rank, 2, model_dir, tmp_path)[0]
    assert start == 1
    assert max_weight_diff(tmp_path / "straight" / "final", Path(final)) <= TOLERANCE
    assert max_weight_diff(model_dir, Path(final)) > 50 * TOLERANCE
