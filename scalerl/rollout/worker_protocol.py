"""What the trainer and its standalone rollout workers say to each other: the requests, their encodings, and
the trainer's end of the conversation, counted.

The trainer's rank 0 drives every worker with tensor messages (`scalerl.rollout.messages`, no pickle):

    GENERATE  -> (step, sampling, prompts)  reply: the generation output of those rows
    WEIGHTS   -> a weight sync              the worker then receives it (`scalerl.comm.weights`: buckets
                                            broadcast over the trainer's rank 0 + workers group, verified,
                                            deltas after the first)
    STOP                                    the worker returns

A worker serves requests strictly in the order they arrive, so the trainer alone decides what runs when:
a prefetched GENERATE must have been answered (`WorkerDriver.receive_outputs`) before WEIGHTS goes out.
A generation output also travels among the trainer's ranks in the same encoding (`broadcast_output`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from scalerl.parallel.distributed import DistContext
from scalerl.rollout.engine import GenerationOutput, SamplingParams
from scalerl.rollout.messages import broadcast_tensors, recv_tensors, send_tensors

OP_GENERATE, OP_WEIGHTS, OP_STOP = 1, 2, 3


def encode_request(step: int, sampling: SamplingParams, prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor):
    """A GENERATE request: the command, sampling parameters, stop tokens and left-padded prompts."""
    params = torch.tensor([sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
                           -1 if sampling.seed is None else sampling.seed, sampling.row_offset,
                           sampling.total_rows or 0], dtype=torch.float64)
    stop = torch.tensor(list(sampling.stop_token_ids) or [-1], dtype=torch.int64)
    return [torch.tensor([OP_GENERATE, step]), params, stop, prompt_ids, prompt_lengths]


def decode_request(message: list[torch.Tensor]) -> tuple[SamplingParams, list[list[int]]]:
    _, params, stop, prompt_ids, lengths = message
    max_new, temperature, top_p, top_k, seed, row_offset, total_rows = params.tolist()
    sampling = SamplingParams(
        max_new_tokens=int(max_new), temperature=temperature, top_p=top_p, top_k=int(top_k),
        stop_token_ids=[t for t in stop.tolist() if t >= 0], seed=None if seed < 0 else int(seed),
        row_offset=int(row_offset), total_rows=int(total_rows) or None,
    )
    width = prompt_ids.shape[1]
    return sampling, [row[width - n :] for row, n in zip(prompt_ids.tolist(), lengths.tolist())]


# Dimensions of the tensors `encode_output` sends: prompt ids and mask, response ids and mask, log-probs, stopped.
OUTPUT_TENSOR_DIMS = (2, 2, 2, 2, 2, 1)


def encode_output(out: GenerationOutput) -> list[torch.Tensor]:
    stopped = torch.tensor([r == "stop" for r in out.finish_reasons], dtype=torch.bool)
    return [out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, out.logprobs, stopped]


def decode_output(message: list[torch.Tensor]) -> GenerationOutput:
    prompt_ids, prompt_mask, response_ids, response_mask, logprobs, stopped = message
    return GenerationOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                            ["stop" if s else "length" for s in stopped.tolist()])


def request_op(message: list[torch.Tensor]) -> int:
    """The command of a request (its first tensor is ``[op, step]``)."""
    return int(message[0][0])


class WorkerDriver:
    """The trainer's rank 0 end: requests to the workers and their replies, each send counted (``rollout``
    or ``weight_sync`` traffic, a point-to-point send of its payload) and timed."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.workers = ctx.rollout_ranks

    def request_generation(self, worker: int, step: int, sampling: SamplingParams, prompt_ids: torch.Tensor,
                           prompt_lengths: torch.Tensor) -> None:
        self._send("rollout", encode_request(step, sampling, prompt_ids, prompt_lengths), worker)

    def receive_outputs(self) -> list[GenerationOutput]:
        """Every worker's reply to its latest GENERATE, in worker order."""
        return [decode_output(recv_tensors(worker, device=self.ctx.device)) for worker in self.workers]

    def announce_weights(self) -> None:
        """Tell every worker a weight sync follows (it then joins the sender's broadcasts)."""
        for worker in self.workers:
            self._send("weight_sync", [torch.tensor([OP_WEIGHTS, 0])], worker)

    def stop(self) -> None:
        for worker in self.workers:
            self._send("rollout", [torch.tensor([OP_STOP, 0])], worker)

    def _send(self, kind: str, tensors: list[torch.Tensor], worker: int) -> int:
        start = time.perf_counter()
        sent = send_tensors(tensors, worker, device=self.ctx.device)
        self.ctx.comm.record(kind, "send", sent, 2, dim="rollout_workers")
        self.ctx.comm.add_wait(kind, time.perf_counter() - start)
        return sent


def broadcast_output(out: GenerationOutput | None, src: int, group, ctx: DistContext) -> GenerationOutput:
    """Global rank ``src``'s ``out`` on every rank of ``group`` (None: the whole world), counted as
    ``rollout`` traffic and timed."""
    start = time.perf_counter()
    message = broadcast_tensors(encode_output(out) if ctx.rank == src else None, src=src, group=group,
                                device=ctx.device)
    # one broadcast per tensor after the header's length and the header (int64: count, then per tensor
    # dtype, ndim, sizes): counted as one payload
    header = 8 * (2 + sum(2 + t.dim() for t in message))
    payload = header + sum(t.numel() * t.element_size() for t in message)
    size = dist.get_world_size(group) if group is not None else ctx.world_size
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    ctx.comm.record("rollout", "broadcast", payload, size, group_rank=ranks.index(ctx.rank), root=ranks.index(src))
    ctx.comm.add_wait("rollout", time.perf_counter() - start)
    return decode_output(message)
