"""Sequence packing (actor.use_remove_padding): packed rows of real tokens give the padded path's logits,
log-probs, losses and gradients for every architecture, kernel and loss aggregation mode, on one process
and under DP, FSDP and TP; a budget shorter than one sequence is an error naming the key."""

from types import SimpleNamespace

import pytest
import torch

from scalerl.algorithms.advantages import grpo_advantages
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.packing import PackedBatch
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.spawned_group import run_in_group

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KERNELS = ["sdpa_per_sequence", "sdpa_block_mask"]
SIZES = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
GEMMA = dict(hidden_act="gelu_pytorch_tanh", sliding_window=3, query_pre_attn_scalar=16,
             final_logit_softcapping=3.0, attention_bias=False, layer_types=["sliding_attention", "full_attention"])
# Windows (3) shorter than the sequences, so the per-sequence window is exercised.
ARCHITECTURES = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", attention_bias=False),
    "mistral": dict(model_type="mistral", attention_bias=False, sliding_window=3,
                    layer_types=["sliding_attention", "sliding_attention"]),
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=5.0, **GEMMA),
    "gemma3": dict(model_type="gemma3_text", rope_local_theta=3000.0, **GEMMA),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      output_router_logits=True),
}


def arch_model(name: str, seed: int = 0):
    return build_model(ModelConfig(**SIZES, **ARCHITECTURES[name]), seed=seed)


def actor_cfg(**kw):
    base = dict(ppo_epochs=1, ppo_mini_batch_size=16, ppo_micro_batch_size=5, clip_ratio_low=0.2,
                clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.01,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", grad_clip=0.0,
                micro_batch_max_tokens=0)
    return SimpleNamespace(**{**base, **kw})


def rollout_batch(model, seed=0):
    """16 rollouts with left-padded prompts of 2-5 tokens and responses stopped early at random."""
    prompts = [[1] + [3 + (i * 7 + j) % 20 for j in range(1 + i % 4)] for i in range(16)]
    out = BuiltinEngine(model, pad_token_id=0).generate(
        prompts, SamplingParams(max_new_tokens=8, seed=seed, stop_token_ids=[2, 7, 11]))
    scores = out.response_lengths.float() + (out.response_ids[:, 0] % 3).float()
    batch = RolloutBatch.from_generation(out, torch.arange(4).repeat_interleave(4), scores)
    batch.old_logprobs = batch.rollout_logprobs - 0.05  # ratios off 1, so the clip and its mask matter
    batch.advantages, batch.returns = grpo_advantages(batch.token_rewards(), batch.response_mask, batch.group_ids)
    return batch


def loss_and_grads(parts, model, batch, plan, mode, ctx):
    """The mini-batch's policy loss (its micro-batch parts summed) and every parameter's full gradient."""
    from scalerl.trainer.objectives import PolicyObjective
    from scalerl.trainer.update import _forward_inputs, mini_batch_counts

    objective = PolicyObjective(actor_cfg(loss_agg_mode=mode), 1.0)
    objective.start_mini_batch(mini_batch_counts(batch, ctx, plan.horizon))
    for p in model.parameters():
        p.grad = None
    parts.train()
    micros = _forward_inputs(parts, batch, plan, objective, ctx)
    assert all(isinstance(m.attention_mask, PackedBatch) == (plan.packed_kernel is not None) for m in micros)
    calls = parts.forward_backward(micros, objective)
    objective.end_mini_batch(calls)
    loss = float(objective.summary()["actor/pg_loss"])
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
    return loss, grads


def plans():
    from scalerl.trainer.update import UpdatePlan

    common = dict(epochs=1, mini_batch_size=16, horizon=8)
    return {"padded": UpdatePlan(micro_batch_size=5, **common),
            "packed": UpdatePlan(micro_batch_size=5, packed_kernel="sdpa_per_sequence", **common),
            "packed_budget": UpdatePlan(micro_batch_size=5, micro_batch_max_tokens=40,
                                        packed_kernel="sdpa_block_mask", **common)}


def max_differences(results):
    """Loss and largest gradient difference of each packed plan against the padded one."""
    loss, grads = results["padded"]
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # a real gradient to compare
    out = {}
    for name, (packed_loss, packed_grads) in results.items():
        if name != "padded":
            assert packed_grads.keys() == grads.keys()
            out[name] = (abs(packed_loss - loss), max(float((packed_grads[k] - grads[k]).abs().max()) for k in grads))
    return out


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_forward_gives_the_padded_logits_and_gradients(name, kernel):
    model = arch_model(name)
    batch = rollout_batch(model)
    ids, mask = batch.input_ids, batch.attention_mask
    keep = batch.response_ids.shape[1] + 1
    assert (mask == 0).any()  # both kinds of padding are there: left of prompts, right of responses
    padded = model(ids, attention_mask=mask, logits_to_keep=keep)
    packed = PackedBatch(ids, mask, kernel)
    assert packed.num_tokens == int(mask.sum())
    out = model(packed.input_ids, attention_mask=packed, logits_to_keep=keep)
    real = mask[:, -keep:].bool()
    assert out.shape == padded.shape
    assert float((out - padded).detach()[real].abs().max()) <= 1e-5
    assert float(out.detach()[~real].abs().max()) == 0.0  # padding reads zeros
    weights = torch.randn_like(padded) * real[..., None]  # gradients of order 10: compared relative
    grads = [torch.autograd.grad((o * weights).sum(), list(model.parameters()), allow_unused=True)
             for o in (padded, out)]
    for a, b in zip(*grads):
        if a is not None:
            assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe"])
def test_packed_update_gives_the_padded_loss_and_gradients_in_every_mode(name):
    from scalerl.parallel.distributed import single_process_context
    from scalerl.parallel.parallelize import parallelize

    model = arch_model(name)
    batch = rollout_batch(model)
    ctx = single_process_context()
    parts = parallelize(model, ctx)
    # The router's aux loss is a mean per forward, so another grouping (the real-token budget's) changes it
    # by design, padded or packed: MoE compares packed and padded rows over the same micro-batches.
    compared = {k: v for k, v in plans().items() if not (name == "qwen2_moe" and k == "packed_budget")}
    for mode in AGG_MODES:
        results = {key: loss_and_grads(parts, model, batch, plan, mode, ctx) for key, plan in compared.items()}
        for plan, (loss_diff, grad_diff) in max_differences(results).items():
            assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (mode, plan, loss_diff, grad_diff)


def test_packed_logprob_and_value_passes_match_the_padded_ones():
    from scalerl.models.value_model import ValueModel
    from scalerl.trainer.forward_passes import response_logprobs, response_values

    model = arch_model("gemma2")
    batch = rollout_batch(model)
    for kernel in KERNELS:
        padded = response_logprobs(model, batch, 0.7, 5)
        packed = response_logprobs(model, batch, 0.7, 5, packed_kernel=kernel)
        assert padded.shape == packed.shape and float((padded - packed).abs().max()) <= 1e-5
    critic = ValueModel(model)
    torch.nn.init.normal_(critic.value_head.weight)  # it starts at zero: values would match trivially
    padded, packed = response_values(critic, batch, 6), response_values(critic, batch, 6, packed_kernel=KERNELS[0])
    assert float((padded - packed).abs().max()) <= 1e-5 and float(padded.abs().max()) > 0


def test_a_budget_shorter_than_one_sequence_is_an_error_naming_the_key():
    from scalerl.parallel.distributed import single_process_context
    from scalerl.trainer.update import token_budget_batches

    batch = rollout_batch(arch_model("qwen2"))
    longest = int(batch.attention_mask.sum(-1).max())
    with pytest.raises(ValueError, match="actor.micro_batch_max_tokens"):
        token_budget_batches(batch, longest - 1, single_process_context(), packed=True)
    micros = token_budget_batches(batch, longest, single_process_context(), packed=True)
    assert all(int(m.attention_mask.sum()) <= longest for m in micros)  # real tokens under the budget


def _layouts_in_group(rank):
    """DP (DDP), FSDP and TP over two ranks: packed and padded updates, every aggregation mode."""
    from scalerl.core.config import ParallelSection
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.parallelize import parallelize

    out = {}
    layouts = {"ddp": ParallelSection(dp_replicate=2), "fsdp": ParallelSection(dp_shard=2),
               "tp": ParallelSection(dp_replicate=1, tp=2)}
    for layout, section in layouts.items():
        ctx = init_distributed(section, torch.device("cpu"))
        for name in ("qwen2", "gemma2"):
            model = arch_model(name)
            batch = rollout_batch(model, seed=rank if layout != "tp" else 0)  # DP ranks hold their own rows
            parts = parallelize(model, ctx)
            for mode in AGG_MODES:
                results = {key: loss_and_grads(parts, model, batch, plan, mode, ctx) for key, plan in plans().items()}
                out[(layout, name, mode)] = max_differences(results)
    return out


def test_packed_updates_match_padded_under_dp_fsdp_and_tp():
    results = run_in_group(_layouts_in_group, 2)
    assert len(results[0]) == 3 * 2 * len(AGG_MODES)
    for rank_results in results:
        for key, diffs in rank_results.items():
            for plan, (loss_diff, grad_diff) in diffs.items():
                assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (key, plan, loss_diff, grad_diff)


def test_the_trainer_with_packing_trains_like_the_padded_one(tiny_config, length_reward, capsys):
    from scalerl.trainer.rl_trainer import RLTrainer

    common = (length_reward, "trainer.total_steps=2", "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
              "actor.loss_agg_mode=seq-mean-token-mean")
    padded = RLTrainer.from_config(tiny_config(*common))
    padded.fit()
    packed = RLTrainer.from_config(tiny_config(*common, "actor.use_remove_padding=true",
                                               "actor.micro_batch_max_tokens=64",
                                               f"trainer.output_dir={padded.output_dir}-packed"))
    assert "attention kernel sdpa_per_sequence" in capsys.readouterr().out  # chosen at start and said
    assert packed.update_plan.packed_kernel == "sdpa_per_sequence"
    packed.fit()
    for model in ("policy", "critic"):
        a, b = getattr(padded, model).model.state_dict(), getattr(packed, model).model.state_dict()
        for name in a:
            assert torch.allclose(a[name], b[name], atol=1e-5), (model, name)


def test_packed_micro_batches_bound_real_tokens_only():
    from scalerl.parallel.seqlen_balance import packed_micro_batches

    lengths = [600, 90, 80, 70, 60, 500, 50, 40, 30, 20]
    batches = packed_micro_batches(lengths, 1200)
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert all(sum(lengths[i] for i in batch) <= 1200 for batch in batches)
    # 600 + 500 + 90 share one: rows x longest (1800) is over the budget, which packed rows never pay.
    assert min(batches, key=len) == [0, 1, 5] and len(batches) == 2
    assert len(packed_micro_batches(lengths, 1200, same_count_across=len(batches) + 2)) == len(batches) + 2
    with pytest.raises(ValueError, match="actor.micro_batch_max_tokens=599"):
        packed_micro_batches(lengths, 599)


def _count_rows(monkeypatch, model):
    """Rows reaching the head and the vocabulary-wide log-softmax/entropy, counted as they run."""
    from scalerl.trainer import forward_passes, objectives

    rows = {"head": 0, "log_softmax": 0, "entropy": 0}

    def counted(key, fn):
        def run(logits, *args, **kwargs):
            rows[key] += logits.shape[:-1].numel()
            return fn(logits, *args, **kwargs)
        return run

    for module in (objectives, forward_passes):
        monkeypatch.setattr(module, "logprobs_from_logits", counted("log_softmax", module.logprobs_from_logits))
    monkeypatch.setattr(objectives, "entropy_from_logits", counted("entropy", objectives.entropy_from_logits))
    head = model.lm_head if hasattr(model, "lm_head") else model.value_head
    head.register_forward_hook(lambda module, args, out: rows.__setitem__("head", rows["head"] + args[0].shape[:-1].numel()))
    return rows


@pytest.mark.parametrize("plan_name", ["padded", "packed", "packed_budget"])
def test_packed_head_and_log_softmax_run_on_the_real_response_tokens_only(monkeypatch, plan_name):
    from scalerl.parallel.distributed import single_process_context
    from scalerl.parallel.parallelize import parallelize
    from scalerl.trainer.forward_passes import response_logprobs

    model = arch_model("qwen2")
    batch = rollout_batch(model)
    batch.response_mask[0, 1] = 0  # an environment token inside a response: real, but not predicted packed
    marked = int((batch.response_mask > 0).sum())
    rows = _count_rows(monkeypatch, model)
    ctx = single_process_context()
    plan = plans()[plan_name]
    loss_and_grads(parallelize(model, ctx), model, batch, plan, "token-mean", ctx)
    update_rows = dict(rows)
    rows.update(head=0, log_softmax=0)
    packed = response_logprobs(model, batch, 1.0, 5, packed_kernel=plan.packed_kernel)
    if plan_name == "padded":  # the counters see padded width: the packed assertions below can fail
        width = batch.response_ids.shape[1]
        assert update_rows["log_softmax"] == update_rows["entropy"] == len(batch) * width > marked
        assert rows["log_softmax"] == len(batch) * width and rows["head"] > marked
        return
    assert update_rows == {"head": marked, "log_softmax": marked, "entropy": marked}
    assert rows["head"] == rows["log_softmax"] == marked
    padded = response_logprobs(model, batch, 1.0, 5)
    assert float((padded - packed).abs().max()) <= 1e-5 and float(packed[0, 1]) == 0.0


def test_the_packed_value_pass_runs_the_value_head_on_the_real_response_tokens_only(monkeypatch):
    from scalerl.models.value_model import ValueModel
    from scalerl.trainer.forward_passes import response_values

    model = arch_model("qwen3")
    batch = rollout_batch(model)
    critic = ValueModel(model)
    torch.nn.init.normal_(critic.value_head.weight)
    rows = _count_rows(monkeypatch, critic)
    packed = response_values(critic, batch, 6, packed_kernel="sdpa_per_sequence")
    assert rows["head"] == int((batch.response_mask > 0).sum())
    assert float((response_values(critic, batch, 6) - packed).abs().max()) <= 1e-5


def _balance_and_pack(rank):
    """Rebalanced across two DP ranks, then cut into packed micro-batches: the per-rank real tokens."""
    from scalerl.core.config import ParallelSection
    from scalerl.parallel.distributed import init_distributed
    from scalerl.trainer.rollout_rebalance import rebalance_batch
    from scalerl.trainer.update import token_budget_batches
    from tests.trainer.test_rollout_rebalance import _skewed_batch

    ctx = init_distributed(ParallelSection(dp_replicate=2), torch.device("cpu"))
    batch, metrics = rebalance_batch(_skewed_batch(rank), ctx, local_groups=2)
    micros = token_budget_batches(batch, 16, ctx, packed=True)
    return {"metrics": metrics, "packed_tokens": sum(int(m.attention_mask.sum()) for m in micros),
            "padded_width": batch.input_ids.numel()}


def test_balancing_across_ranks_counts_the_tokens_the_packed_budget_counts():
    results = run_in_group(_balance_and_pack, 2)
    tokens = [r["packed_tokens"] for r in results]
    # The imbalance the rebalancer reports is that of the real tokens each rank's packed micro-batches hold
    # (padded widths would give another number: the rows differ in padding).
    assert results[0]["metrics"]["balance/token_imbalance"] == pytest.approx(max(tokens) / (sum(tokens) / 2))
    assert all(r["padded_width"] > r["packed_tokens"] for r in results)
