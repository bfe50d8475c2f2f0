"""A rollout as trajectory: prompt, then segments of the engine's tokens and of tokens from elsewhere, laid out
as the GenerationOutput every source hands over, with the loss mask that says which tokens are trained."""

from __future__ import annotations

import pytest
import torch

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.engine import GenerationOutput
from scalerl.rollout.trajectory import Trajectory, TrajectorySegment, trajectories_to_output
from scalerl.rollout.worker.protocol import decode_output, encode_output

PAD = 0


def two_turns(prompt=(5, 6, 7), version=3) -> Trajectory:
    """An engine turn, a tool result (2 tokens), a second engine turn."""
    return Trajectory(list(prompt), [TrajectorySegment([11, 12, 13], True, [-0.1, -0.2, -0.3], version),
                                     TrajectorySegment([40, 41], False),
                                     TrajectorySegment([14, 2], True, [-0.4, -0.5], version + 1)],
                      reward_inputs={"ground_truth": "42"})


def test_segments_are_laid_out_with_their_loss_mask_logprobs_and_versions():
    single = Trajectory([8, 9], [TrajectorySegment([21, 22], True, [-1.0, -2.0], 0)], finish_reason="length")
    out = trajectories_to_output([two_turns(), single], PAD)
    assert out.response_ids.tolist() == [[11, 12, 13, 40, 41, 14, 2], [21, 22, 0, 0, 0, 0, 0]]
    assert out.response_mask.tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]
    assert out.loss_mask.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    assert out.prompt_ids.tolist() == [[5, 6, 7], [0, 8, 9]] and out.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert torch.allclose(out.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5]))
    assert out.weight_versions[0].tolist() == [3, 3, 3, -1, -1, 4, 4] and out.finish_reasons == ["stop", "length"]
    assert out.trained_mask.tolist() == [[1.0, 1, 1, 0, 0, 1, 1], [1.0, 1, 0, 0, 0, 0, 0]]
    assert two_turns().num_turns == 2 and two_turns().response_ids == [11, 12, 13, 40, 41, 14, 2]


def test_a_single_turn_is_the_one_segment_case():
    """One generated segment trains every real token, as a plain engine output without a loss mask does."""
    out = trajectories_to_output([Trajectory([8, 9], [TrajectorySegment([21, 22], True, [-1.0, -2.0])])], PAD)
    plain = GenerationOutput(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, out.logprobs,
                             out.finish_reasons)
    assert torch.equal(out.trained_mask, plain.trained_mask) and out.weight_versions is None
    a = RolloutBatch.from_generation(out, torch.zeros(1, dtype=torch.long), torch.ones(1))
    b = RolloutBatch.from_generation(plain, torch.zeros(1, dtype=torch.long), torch.ones(1))
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.token_rewards(), b.token_rewards())


def test_the_batch_trains_the_engines_tokens_and_places_the_reward_on_the_last_real_token():
    """The tool's tokens are out of the loss but in the sequence: the reward sits on the last real token, the
    length counts every real token, and trimming keeps a trailing tool segment's columns."""
    ends_with_tool = Trajectory([5], [TrajectorySegment([11], True, [-0.1]), TrajectorySegment([40, 41], False)])
    batch = RolloutBatch.from_generation(trajectories_to_output([two_turns(), ends_with_tool], PAD),
                                         torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))
    assert batch.response_mask.tolist() == [[1.0, 1, 1, 0, 0, 1, 1], [1.0, 0, 0, 0, 0, 0, 0]]
    assert batch.response_lengths.tolist() == [7, 3]
    assert batch.token_rewards()[1].tolist() == [0, 0, 2.0, 0, 0, 0, 0]
    trimmed, _, right = batch.select(torch.tensor([1])).trimmed()
    assert right == 4 and trimmed.response_ids.tolist() == [[11, 40, 41]]


def test_the_loss_mask_survives_rows_concat_and_the_worker_protocol():
    out = trajectories_to_output([two_turns(), two_turns(prompt=(9,))], PAD)
    assert torch.equal(out.rows(1, 2).loss_mask, out.loss_mask[1:2])
    plain = GenerationOutput(torch.tensor([[3]]), torch.tensor([[1]]), torch.tensor([[17, 2]]), torch.tensor([[1, 1]]),
                             torch.tensor([[-0.1, -0.2]]), ["stop"])
    joined = GenerationOutput.concat([out, plain], PAD)
    assert joined.loss_mask.tolist()[2] == [1, 1, 0, 0, 0, 0, 0]  # a part without a mask: all the engine's
    again = decode_output(encode_output(out))
    assert torch.equal(again.loss_mask, out.loss_mask) and decode_output(encode_output(plain)).loss_mask is None


def test_a_generated_segment_needs_its_logprobs():
    with pytest.raises(ValueError, match="a generated segment of 2 tokens needs as many log-probs"):
        TrajectorySegment([1, 2], True, [-0.1])


def test_sampled_tokens_a_segment_masks_stay_with_their_logprobs_out_of_the_loss():
    """A generated segment's own loss mask (a verl loop's response_mask 0 on sampled tokens): the ids and the
    engine's log-probs stay in place, the batch trains none of the masked tokens."""
    masked = TrajectorySegment([11, 12, 13], True, [-0.1, -0.2, -0.3], 3, loss_mask=[1, 0, 0])
    t = Trajectory([5], [masked, TrajectorySegment([40], False), TrajectorySegment([14], True, [-0.4], 4)])
    out = trajectories_to_output([t], PAD)
    assert out.loss_mask.tolist() == [[1, 0, 0, 0, 1]] and out.response_mask.tolist() == [[1] * 5]
    assert torch.allclose(out.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0, -0.4]))
    assert out.weight_versions[0].tolist() == [3, 3, 3, -1, 4] and t.num_turns == 2
    batch = RolloutBatch.from_generation(out, torch.zeros(1, dtype=torch.long), torch.ones(1))
    assert batch.response_mask.tolist() == [[1.0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="a loss mask of 2 values on a generated segment of 3 tokens"):
        TrajectorySegment([1, 2, 3], True, [-0.1] * 3, loss_mask=[1, 0])
    with pytest.raises(ValueError, match="on a non-generated segment"):
        TrajectorySegment([1], False, loss_mask=[0])
