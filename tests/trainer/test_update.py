"""The update loop: gradient accumulation does not change the update; the policy moves toward reward;
non-finite steps are skipped and counted; fp16 loss scaling reaches the critic too."""

from types import SimpleNamespace

import pytest
import torch

from scalerl.algorithms.advantages import grpo_advantages
from scalerl.models.value_model import ValueModel
from scalerl.parallel.distributed import single_process_context
from scalerl.parallel.parallelize import parallelize
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.trainer.forward_passes import response_logprobs
from scalerl.trainer.objectives import PolicyObjective, ValueObjective
from scalerl.trainer.update import OptimizerStep, UpdatePlan, run_update
from tests.tiny import tiny_model


def update_policy(model, opt, batch, cfg, temperature, horizon, generator, scaler=None):
    plan = UpdatePlan(epochs=cfg.ppo_epochs, mini_batch_size=cfg.ppo_mini_batch_size,
                      micro_batch_size=cfg.ppo_micro_batch_size, micro_batch_max_tokens=cfg.micro_batch_max_tokens,
                      horizon=horizon)
    return run_update(parallelize(model, single_process_context()), OptimizerStep(opt, scaler, cfg.grad_clip), batch,
                      PolicyObjective(cfg, temperature), plan, generator, single_process_context())


def _actor_cfg(**kw):
    base = dict(ppo_epochs=1, ppo_mini_batch_size=32, ppo_micro_batch_size=32, clip_ratio_low=0.2,
                clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.0,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", grad_clip=0.0,
                micro_batch_max_tokens=0)
    return SimpleNamespace(**{**base, **kw})


def _batch(model, seed=0):
    engine = BuiltinEngine(model, pad_token_id=0)
    prompts = [[1, 3 + i % 4, 5 + i % 3] for i in range(8) for _ in range(4)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=seed, stop_token_ids=[2, 7]))
    scores = (out.response_ids[:, 0] == 5).float() + 0.1 * out.response_lengths
    batch = RolloutBatch.from_generation(out, torch.arange(8).repeat_interleave(4), scores)
    batch.old_logprobs = batch.rollout_logprobs
    batch.advantages, batch.returns = grpo_advantages(batch.token_rewards(), batch.response_mask, batch.group_ids)
    return batch


def _model():
    return tiny_model(vocab_size=16)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_gives_the_same_update(mode):
    results = []
    for micro in (32, 8, 5):
        model = _model()
        batch = _batch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # linear in the gradient: exposes any rescaling
        update_policy(model, opt, batch, _actor_cfg(ppo_micro_batch_size=micro, loss_agg_mode=mode), 1.0, 6,
                      torch.Generator().manual_seed(0))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6)
    assert torch.allclose(results[0], results[2], atol=1e-6)


def test_update_raises_the_likelihood_of_better_samples():
    model = _model()
    batch = _batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    update_policy(model, opt, batch, _actor_cfg(), 1.0, 6, torch.Generator().manual_seed(0))
    delta = (response_logprobs(model, batch, 1.0, 32) - batch.old_logprobs).sum(-1)
    adv = batch.advantages[:, 0]
    assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()


def test_token_budget_micro_batches_give_the_same_update():
    results = []
    for budget in (0, 40, 90):
        model = _model()
        batch = _batch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        update_policy(model, opt, batch, _actor_cfg(ppo_micro_batch_size=32, micro_batch_max_tokens=budget), 1.0, 6,
                      torch.Generator().manual_seed(0))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6) and torch.allclose(results[0], results[2], atol=1e-6)


def test_a_non_finite_gradient_skips_the_step_and_is_counted():
    model = _model()
    batch = _batch(model)
    batch.advantages = batch.advantages.clone()
    batch.advantages[0, 0] = float("nan")  # poisons the loss, hence every gradient
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = update_policy(model, opt, batch, _actor_cfg(ppo_mini_batch_size=16, ppo_micro_batch_size=8), 1.0, 6,
                            torch.Generator().manual_seed(0))
    assert metrics["actor/skipped_steps"] == 1.0  # the mini-batch holding row 0; the other one stepped
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert any(moved)


def test_fp16_loss_scaling_reaches_the_critic_update():
    model = _model()
    batch = _batch(model)
    critic = ValueModel(model)
    batch.values = torch.zeros_like(batch.response_mask)
    batch.returns = batch.token_rewards()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    seen = []
    real_backward = torch.Tensor.backward

    def record_backward(loss, *args, **kwargs):
        seen.append(float(loss.detach()))
        return real_backward(loss, *args, **kwargs)

    cfg = SimpleNamespace(cliprange_value=0.5, value_loss_coef=0.5)
    objective = ValueObjective(cfg, "token-mean")
    plan = UpdatePlan(epochs=1, mini_batch_size=32, micro_batch_size=16, horizon=6)
    torch.Tensor.backward = record_backward
    try:
        metrics = run_update(parallelize(critic, single_process_context()), OptimizerStep(opt, scaler, 1.0), batch,
                             objective, plan, torch.Generator().manual_seed(0), single_process_context())
    finally:
        torch.Tensor.backward = real_backward
    # The backward ran on the scaled loss: value_loss_coef * loss * 2^10 per micro-batch.
    assert len(seen) == 2 and all(v > 100 * metrics["critic/vf_loss"] / 2 for v in seen)
    assert metrics["critic/vf_loss"] > 0 and metrics["critic/skipped_steps"] == 0
    assert scaler.get_scale() == 2.0**10  # finite gradients: the scale was not cut


def test_bf16_casts_held_over_micro_batches_give_the_per_micro_batch_gradients():
    """`Autocast.holding_casts`: the weights are cast once for all micro-batches instead of once each; the
    gradients (and the log-probs) are the ones per-micro-batch autocast gives, loss and backward in fp32."""
    from scalerl.core.device import Autocast

    autocast = Autocast("bf16", torch.device("cpu"))
    model = tiny_model(seed=3)
    batch = _batch(model)
    objective = PolicyObjective(_actor_cfg(), 1.0)
    ctx = single_process_context()
    parts = parallelize(model, ctx)

    def grads(hold: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        original = Autocast.holding_casts
        if not hold:  # the previous behaviour: each micro-batch's forward in its own autocast
            Autocast.holding_casts = lambda self: __import__("contextlib").nullcontext()
        try:
            from scalerl.trainer.update import _forward_inputs, mini_batch_counts
            plan = UpdatePlan(epochs=1, mini_batch_size=32, micro_batch_size=8, shuffle=False)
            objective.start_mini_batch(mini_batch_counts(batch, ctx, None))
            micros = _forward_inputs(parts, batch, plan, objective, ctx)
            assert len(micros) == 4
            parts.forward_backward(micros, objective, autocast)
            logprobs = response_logprobs(model, batch, 1.0, 8, autocast)
        finally:
            Autocast.holding_casts = original
        return {**{n: p.grad.clone() for n, p in model.named_parameters()}, "logprobs": logprobs}

    held, per_micro = grads(True), grads(False)
    assert all(g.dtype == torch.float32 for g in held.values())  # fp32 master gradients, fp32 log-probs
    for name, value in held.items():
        torch.testing.assert_close(value, per_micro[name], rtol=1e-5, atol=1e-6, msg=name)
    assert held["layers.0.mlp.up_proj.weight"].abs().sum() > 0
