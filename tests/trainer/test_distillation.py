"""On-policy distillation in the RL trainer (`algorithm.distill`): the teacher's log-probs of the student's own
tokens come from its forward over the step's batch, each token's advantage is ``coef * (teacher - student)``
(alone, or added to the task estimator's weighted by ``task_weight``), the student moves toward the teacher,
and a teacher that cannot score the student's tokens is refused at start naming the key."""

from __future__ import annotations

import pytest
import torch

from scalerl.algorithms import grpo_advantages
from scalerl.core.config import ConfigError
from scalerl.trainer.forward_passes import response_logprobs
from scalerl.trainer.rl_trainer import RLTrainer
from tests.tiny import save_tiny_teacher

WIDER = ("model.hidden_size=64", "model.intermediate_size=128")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return save_tiny_teacher(tmp_path_factory.mktemp("teacher") / "model", 7, *WIDER)


def _steps(config, count):
    batches = []
    trainer = RLTrainer.from_config(config, on_batch=batches.append)
    metrics = []
    for _ in range(count):
        metrics.append(trainer.advance())
    return trainer, batches, metrics


def test_each_tokens_advantage_is_the_teachers_log_prob_minus_the_students(tiny_config, length_reward, teacher):
    trainer, (batch,), (metrics,) = _steps(tiny_config(length_reward, f"algorithm.distill.teacher={teacher}",
                                                       "algorithm.distill.coef=0.5"), 1)
    assert trainer.teacher is not None and not any(p.requires_grad for p in trainer.teacher.model.parameters())
    mask = batch.response_mask
    # The teacher's own forward on the batch (an independent pass, not the trainer's stored tensor).
    expected_teacher = response_logprobs(trainer.teacher.model, batch, 1.0, 4, trainer.autocast)
    assert torch.allclose(batch.teacher_logprobs * mask, expected_teacher * mask, atol=1e-6)
    gap = (batch.teacher_logprobs - batch.old_logprobs) * mask
    assert torch.allclose(batch.advantages, 0.5 * gap)  # task_weight=0: distillation alone
    assert batch.advantages.abs().sum() > 0
    assert metrics["distill/reverse_kl"] == pytest.approx(float(-(gap.sum() / mask.sum())), rel=1e-5)
    assert metrics["distill/reverse_kl"] > 0  # two different random models: the student's tokens are its own likelier
    assert metrics["timing_s/teacher"] > 0


def test_with_the_task_reward_the_estimators_advantage_is_added(tiny_config, length_reward, teacher):
    _, (batch,), _ = _steps(tiny_config(length_reward, f"algorithm.distill.teacher={teacher}",
                                        "algorithm.distill.task_weight=2.0"), 1)
    grpo, _ = grpo_advantages(batch.token_rewards(), batch.response_mask, batch.group_ids)
    distill = (batch.teacher_logprobs - batch.old_logprobs) * batch.response_mask
    assert torch.allclose(batch.advantages, 2.0 * grpo + distill, atol=1e-6)


def test_the_update_moves_the_student_toward_the_teacher_on_its_tokens(tiny_config, length_reward, teacher):
    """One step at a large learning rate, then the student's log-probs of that step's own tokens: the tokens the
    teacher likes better than the student did rose, and the sampled reverse KL on them fell."""
    trainer, (batch,), _ = _steps(tiny_config(length_reward, f"algorithm.distill.teacher={teacher}",
                                              "actor.lr=1e-2", "actor.grad_clip=0"), 1)
    mask = batch.response_mask
    after = response_logprobs(trainer.policy.model, batch, 1.0, 4, trainer.autocast)
    moved = (after - batch.old_logprobs) * mask
    assert float((moved * batch.advantages).sum()) > 0  # the surrogate the policy loss maximises went up
    before_kl = ((batch.old_logprobs - batch.teacher_logprobs) * mask).sum() / mask.sum()
    after_kl = ((after - batch.teacher_logprobs) * mask).sum() / mask.sum()
    assert after_kl < before_kl


def test_a_teacher_that_cannot_score_the_students_tokens_is_refused_at_start(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher=.*is not a model directory \(no config.json"):
        RLTrainer.from_config(tiny_config(f"algorithm.distill.teacher={tmp_path / 'missing'}"))
    other = save_tiny_teacher(tmp_path / "other", 7)
    # Another tokenizer: a one-token-per-word vocabulary written over the teacher's own files.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "Question:": 4, "Answer:": 5}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(other / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher=.*has another tokenizer than the student "
                                          r"\(vocabulary 6 vs the student's 99\).*same tokenizer"):
        RLTrainer.from_config(tiny_config(f"algorithm.distill.teacher={other}"))
    with pytest.raises(ConfigError, match="algorithm.distill.teacher is empty"):
        tiny_config("algorithm.distill.teacher=' '")
