"""The rollout worker protocol's encodings: a GENERATE request and a generation output survive the trip
as tensors (no pickle), prompts unpadded again and every sampling field kept."""

from __future__ import annotations

import torch

from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams, left_pad
from scalerl.rollout.worker.protocol import (
    OP_GENERATE,
    decode_output,
    decode_request,
    encode_output,
    encode_request,
    request_op,
)


def test_a_request_round_trips():
    prompts = [[5, 6, 7], [8]]
    ids, mask = left_pad(prompts, pad_token_id=0)
    for sampling in (SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[2, 3],
                                    seed=11, row_offset=4, total_rows=12),
                     SamplingParams(max_new_tokens=1, temperature=0.0)):  # no seed, no stop tokens, no total
        message = encode_request(7, sampling, ids, mask.sum(-1))
        assert request_op(message) == OP_GENERATE and int(message[0][1]) == 7
        decoded, rows = decode_request(message)
        assert rows == prompts
        assert decoded == SamplingParams(**{**sampling.__dict__, "stop_token_ids": list(sampling.stop_token_ids)})


def test_an_output_round_trips():
    out = GenerationOutput(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]]),
                           torch.tensor([[1, 2], [3, 0]]), torch.tensor([[1, 1], [1, 0]]),
                           torch.tensor([[-0.5, -1.5], [-2.0, 0.0]]), ["length", "stop"])
    message = encode_output(out)
    assert all(isinstance(t, torch.Tensor) for t in message)
    back = decode_output(message)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(back, name), getattr(out, name)), name
    assert back.finish_reasons == ["length", "stop"]


def test_every_token_carries_its_policy_version_and_the_reply_its_idle_time():
    from scalerl.rollout.worker.protocol import (
        decode_reply,
        encode_reply,
        token_versions,
    )

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = GenerationOutput(torch.tensor([[5], [6]]), torch.ones(2, 1, dtype=torch.long), torch.tensor([[1, 2, 0], [3, 0, 0]]),
                           mask, torch.zeros(2, 3), ["stop", "stop"], token_versions(mask, 7))
    assert out.weight_versions.tolist() == [[7, 7, -1], [7, -1, -1]]
    reply = decode_reply(encode_reply(out, step=4, idle_s=0.5, gen_s=1.5, row_start=6))
    assert torch.equal(reply.out.weight_versions, out.weight_versions)
    assert (reply.step, reply.idle_s, reply.gen_s, reply.row_start) == (4, 0.5, 1.5, 6)
    unknown = decode_output(encode_output(GenerationOutput(out.prompt_ids, out.prompt_mask, out.response_ids, mask,
                                                           out.logprobs, out.finish_reasons)))
    assert (unknown.weight_versions == -1).all()  # no versions known: -1, never a plausible version
    joined = GenerationOutput.concat([out.rows(0, 1), out.rows(1, 2)], pad_token_id=0)
    assert joined.weight_versions.tolist() == [[7, 7], [7, -1]]


def _worker_leaves_without_answering(rank: int):
    from types import SimpleNamespace

    from scalerl.comm.counting.accounting import CommCounter
    from scalerl.rollout.worker.messages import recv_tensors
    from scalerl.rollout.worker.protocol import RolloutWorkerError, WorkerDriver

    if rank == 1:  # takes the request, then its process group goes away (as when the process dies)
        recv_tensors(0)
        return "left"
    driver = WorkerDriver(SimpleNamespace(rollout_ranks=[1], device=torch.device("cpu"), comm=CommCounter()))
    driver.request_generation(1, 5, SamplingParams(max_new_tokens=2), torch.ones(1, 2, dtype=torch.long),
                              torch.tensor([2]), tokens=4)
    try:
        driver.receive(1)
    except RolloutWorkerError as e:
        return str(e)
    return "answered"


def test_a_worker_that_goes_away_is_named_over_gloo():
    from tests.spawned_group import run_in_group

    message, _ = run_in_group(_worker_leaves_without_answering, 2, timeout_s=120)
    assert message.startswith("rollout workers [1] all stopped answering (the last, rank 1, owed the rollouts of "
                              "steps [5])")
    assert "trainer.resume=auto" in message


def test_an_agent_request_carries_its_rows_and_the_reply_its_rewards_and_metrics():
    """An agent run's GENERATE brings its data rows (JSON bytes); the answer brings the trajectories' loss mask,
    each row's environment reward (none: the run's reward function scores it) and the worker's agent metrics."""
    import pytest

    from scalerl.core.errors import UserError
    from scalerl.rollout.worker.protocol import decode_reply, encode_reply, request_rows

    ids, mask = left_pad([[5, 6], [7]], pad_token_id=0)
    rows = [{"prompt": "1+1=", "ground_truth": "2", "turns": ["again"]}, {"prompt": "ü", "info": {"k": [1, None]}}]
    message = encode_request(3, SamplingParams(max_new_tokens=4), ids, mask.sum(-1), rows)
    assert request_rows(message) == rows and decode_request(message)[1] == [[5, 6], [7]]
    assert request_rows(encode_request(3, SamplingParams(max_new_tokens=4), ids, mask.sum(-1))) is None
    with pytest.raises(UserError, match="JSON"):
        encode_request(3, SamplingParams(max_new_tokens=4), ids, mask.sum(-1), [{"prompt": object()}, {}])

    out = GenerationOutput(ids, mask, torch.tensor([[1, 2, 3], [4, 0, 0]]), torch.tensor([[1, 1, 1], [1, 0, 0]]),
                           torch.tensor([[-0.5, 0.0, -0.25], [-1.0, 0.0, 0.0]]), ["stop", "length"],
                           torch.tensor([[4, -1, 5], [4, -1, -1]], dtype=torch.int32),
                           torch.tensor([[1, 0, 1], [1, 0, 0]]), [{"env_reward": 0.25, "row": rows[0]}, {"env_reward": None}])
    reply = decode_reply(encode_reply(out, 3, 0.5, 1.5, 8, {"agent/turns/max": 2.0}))
    assert (reply.step, reply.row_start, reply.metrics) == (3, 8, {"agent/turns/max": 2.0})
    assert torch.equal(reply.out.loss_mask, out.loss_mask) and torch.equal(reply.out.weight_versions, out.weight_versions)
    assert reply.out.reward_inputs == [{"env_reward": 0.25}, {}]
    plain = decode_reply(encode_reply(out, 3, 0.5, 1.5, 8))
    assert plain.metrics == {} and plain.out.reward_inputs == [{"env_reward": 0.25}, {}]
