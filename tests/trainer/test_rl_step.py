"""The rollout phase's seam: a multi-turn trajectory's tokens from elsewhere (tool results, user turns) are
context, never trained. The log-prob passes, the policy loss, its KL term, entropy and metrics read the loss
mask, so whatever stands at those positions changes nothing in the gradient; and the prompt feed draws
steps reproducibly."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from scalerl.algorithms.advantages import grpo_advantages
from scalerl.parallel.distributed import single_process_context
from scalerl.parallel.parallelize import parallelize
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.trajectory import Trajectory, TrajectorySegment, trajectories_to_output
from scalerl.trainer.forward_passes import response_logprobs
from scalerl.trainer.objectives import PolicyObjective
from scalerl.trainer.rl_step import rollout_seed
from scalerl.trainer.update import OptimizerStep, UpdatePlan, run_update
from tests.tiny import tiny_model

ACTOR = SimpleNamespace(ppo_epochs=1, ppo_mini_batch_size=4, ppo_micro_batch_size=2, clip_ratio_low=0.2,
                        clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.01,
                        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", grad_clip=0.0,
                        micro_batch_max_tokens=0)


def _trajectories() -> list[Trajectory]:
    """Four two-turn rollouts (two groups of two): an engine turn, a tool result, an engine turn."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, 64, (n,), generator=g).tolist()

    out = []
    for row in range(4):
        first, tool, second = ids(2 + row % 2), ids(3), ids(2)
        out.append(Trajectory(ids(3), [TrajectorySegment(first, True, [0.0] * len(first)),
                                       TrajectorySegment(tool, False), TrajectorySegment(second, True, [0.0] * 2)]))
    return out


def _batch(model, loss_mask=True) -> RolloutBatch:
    out = trajectories_to_output(_trajectories(), 0)
    if not loss_mask:
        out.loss_mask = None
    batch = RolloutBatch.from_generation(out, torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 0.5, 2.0]))
    batch.old_logprobs = response_logprobs(model, batch, 1.0, 2)
    batch.ref_logprobs = batch.old_logprobs - 0.05 * torch.arange(batch.response_ids.shape[1])
    batch.advantages, batch.returns = grpo_advantages(batch.token_rewards(), batch.response_mask, batch.group_ids)
    return batch


def _update(model, batch) -> tuple[torch.Tensor, dict[str, float]]:
    """The parameters after one SGD step of the policy loss (linear in the gradient) and its metrics."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    plan = UpdatePlan(epochs=1, mini_batch_size=4, micro_batch_size=2, micro_batch_max_tokens=0, horizon=8)
    metrics = run_update(parallelize(model, single_process_context()), OptimizerStep(opt, None, 0.0), batch,
                         PolicyObjective(ACTOR, 1.0), plan, torch.Generator().manual_seed(0), single_process_context())
    return torch.cat([p.detach().flatten() for p in model.parameters()]), metrics


def test_the_log_prob_pass_is_the_forward_on_trained_tokens_and_zero_on_the_rest():
    model = tiny_model(seed=1)
    batch = _batch(model)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)[:, batch.prompt_len - 1: -1]
    full = logits.float().log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    trained = batch.response_mask.bool()
    assert torch.allclose(batch.old_logprobs[trained], full[trained], atol=1e-5)
    assert not batch.old_logprobs[~trained].any()
    assert (~trained & batch.response_attention.bool()).sum() == 12  # the tool's 3 tokens in each of 4 rows


def test_tokens_from_elsewhere_change_nothing_in_the_gradient_the_kl_or_the_metrics():
    model = tiny_model(seed=1)
    batch = _batch(model)
    tool = (batch.response_attention > 0) & (batch.response_mask == 0)
    garbage = copy.deepcopy(batch)  # every per-token input at the tool's positions set to nonsense
    for name in ("old_logprobs", "ref_logprobs", "advantages", "rollout_logprobs"):
        getattr(garbage, name)[tool] = 7.0
    garbage.is_weights = torch.where(tool, 100.0, 1.0)
    params, metrics = _update(model, batch)
    params_garbage, metrics_garbage = _update(model, garbage)
    assert torch.equal(params, params_garbage)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert metrics[key] == metrics_garbage[key], key
    # and the test can fail: the same rows with every token trained, or a trained position changed, move it
    assert not torch.equal(params, _update(model, _batch(model, loss_mask=False))[0])
    changed = copy.deepcopy(batch)
    changed.advantages[~tool & (batch.response_mask > 0)] += 1.0
    assert not torch.equal(params, _update(model, changed)[0])


def test_rollout_seeds_are_fixed_by_step_and_round():
    assert rollout_seed(3, 5) == rollout_seed(3, 5) and rollout_seed(3, 5) != rollout_seed(3, 6)
    assert rollout_seed(3, 5, 1) not in (rollout_seed(3, 5), rollout_seed(3, 5, 2))
