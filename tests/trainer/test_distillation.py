"""On-policy distillation in the RL trainer (`algorithm.distill`): the teacher's log-probs of the student's own
tokens come from its forward over the step's batch, each token's advantage is ``coef * (teacher - student)``
(alone, or added to the task estimator's weighted by ``task_weight``), the student moves toward the teacher,
and a teacher that cannot score the student's tokens is refused at start naming the key. With ``top_k`` the
teacher's top-k is kept and its forward KL trained as a loss term; with ``teachers`` each row is scored by its
data source's teacher."""

from __future__ import annotations

import pytest
import torch

from scalerl.algorithms import grpo_advantages
from scalerl.algorithms.distillation import topk_forward_kl
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


# --- top-k (algorithm.distill.top_k) --------------------------------------------------------------------------


def _response_logits(model, batch):
    """The model's own logits at the positions that predict each response token ``[B, R, V]`` (one plain
    forward over the padded batch: an independent reading of what the passes compute)."""
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
    return logits[:, batch.prompt_len - 1 : -1].float()


def test_top_k_keeps_the_teachers_top_k_and_trains_the_forward_kl_on_it(tiny_config, length_reward, teacher):
    import copy

    k = 3
    trainer = RLTrainer.from_config(tiny_config(length_reward, f"algorithm.distill.teacher={teacher}",
                                                f"algorithm.distill.top_k={k}", "algorithm.distill.coef=0.5",
                                                "actor.ppo_mini_batch_size=16", "actor.lr=1e-2", "actor.grad_clip=0"),
                                    on_batch=(batches := []).append)
    before = copy.deepcopy(trainer.policy.model)
    metrics = trainer.advance()
    (batch,) = batches
    mask = batch.response_mask.bool()
    assert batch.teacher_topk.shape == (*batch.response_ids.shape, 2 * k)  # [B, R, 2k], not [B, R, V]
    teacher_logp = torch.log_softmax(_response_logits(trainer.teacher.model, batch), -1)
    top = teacher_logp.topk(k, -1)
    assert torch.equal(batch.teacher_topk[..., :k][mask].long(), top.indices[mask])
    assert torch.allclose(batch.teacher_topk[..., k:][mask], top.values[mask], atol=1e-5)
    assert torch.allclose(batch.teacher_logprobs[mask], teacher_logp.gather(-1, batch.response_ids[..., None])[..., 0][mask],
                          atol=1e-5)
    # the distillation is the loss's term: with task_weight=0 the advantages are all zero
    assert batch.advantages.abs().sum() == 0
    assert 0 < metrics["distill/teacher_mass"] <= 1
    # One mini-batch: the loss's term is the pre-update student's token-mean top-k forward KL on the batch.
    kl_before = topk_forward_kl(_response_logits(before, batch), batch.teacher_topk)[mask].mean()
    assert metrics["actor/distill_topk_kl"] == pytest.approx(float(kl_before), rel=1e-4)
    kl_after = topk_forward_kl(_response_logits(trainer.policy.model, batch), batch.teacher_topk)[mask].mean()
    assert kl_after < kl_before  # the update pulled the student toward the teacher's top-k


def test_top_k_with_a_teacher_of_another_vocabulary_size_is_refused(tiny_config, tmp_path):
    from scalerl.models.hf_checkpoint import save_pretrained
    from scalerl.models.tokenizer import CharTokenizer
    from tests.tiny import tiny_model

    tokenizer = CharTokenizer()  # the same tokenizer, another padded output vocabulary than the student's 128
    padded = save_pretrained(tiny_model(7, vocab_size=160), tmp_path / "padded", tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=r"algorithm.distill.top_k=2 compares .* predicts over 160 tokens and the "
                                          r"student over 128 .*use a teacher with the student's vocabulary size"):
        RLTrainer.from_config(tiny_config(f"algorithm.distill.teacher={padded}", "algorithm.distill.top_k=2"))


# --- several teachers, each for its data source (algorithm.distill.teachers) ------------------------------------


def test_each_row_is_scored_by_its_sources_teacher(tiny_config, length_reward, teacher, tmp_path):
    """Three sources, two teachers (and a mapped source no row has): each row's teacher log-probs are its own
    teacher's alone on the batch; a row of the source without one gets no distillation term."""
    import json

    other = save_tiny_teacher(tmp_path / "other", 11)
    rows = [{"prompt": f"{s}:{i}+1=", "ground_truth": str(i + 1), "data_source": source}
            for i in range(24) for s, source in [("a", "alpha"), ("b", "beta"), ("g", "gamma")]]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mapping = f"{{alpha: {teacher}, beta: {other}, delta: {teacher}}}"
    with pytest.warns(UserWarning, match=r"algorithm.distill.teachers names data source\(s\) \['delta'\], which no "
                                         r"row of the first batch has"):
        trainer, (batch,), (metrics,) = _steps(tiny_config(length_reward, f"algorithm.distill.teachers={mapping}",
                                                           f"data.train_files=[{data}]", f"data.val_files=[{data}]",
                                                           "trainer.batch_size=6"), 1)
    assert sorted(trainer.teacher.by_path) == sorted([str(teacher), str(other)])  # one model per directory
    prompts = [trainer.tokenizer.decode(ids[mask.bool()].tolist())
               for ids, mask in zip(batch.input_ids[:, : batch.prompt_len], batch.attention_mask[:, : batch.prompt_len])]
    source = [p.strip()[0] for p in prompts]
    assert set(source) == {"a", "b", "g"}  # the batch holds every source
    mask = batch.response_mask
    alone = {path: response_logprobs(parts.model, batch, 1.0, 4, trainer.autocast)
             for path, parts in trainer.teacher.by_path.items()}
    for row, s in enumerate(source):
        if s == "g":
            assert not batch.distilled[row] and batch.advantages[row].abs().sum() == 0
            continue
        own = alone[str(teacher) if s == "a" else str(other)]
        assert batch.distilled[row]
        assert torch.allclose(batch.teacher_logprobs[row] * mask[row], own[row] * mask[row], atol=1e-5)
        assert torch.allclose(batch.advantages[row], (own[row] - batch.old_logprobs[row]) * mask[row], atol=1e-5)
    # the two teachers differ: a row's log-probs are not the other teacher's
    a_row = source.index("a")
    assert not torch.allclose(alone[str(other)][a_row] * mask[a_row], batch.teacher_logprobs[a_row] * mask[a_row])
    assert metrics["distill/distilled_rows"] == pytest.approx(sum(s != "g" for s in source) / len(source))
