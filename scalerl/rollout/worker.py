"""A standalone rollout worker: a rank outside the trainer's mesh with its own copy of the policy (in
``rollout.dtype``), serving the trainer's requests in order until told to stop.

The trainer's rank 0 drives every worker with tensor messages (`scalerl.rollout.messages`, no pickle):

    GENERATE  -> (sampling, prompts)      reply: the generation output of those rows
    WEIGHTS   -> a weight sync             receive it (`scalerl.comm.weights.sender`: buckets broadcast over the
                                           trainer's rank 0 + workers group, verified, deltas after the first)
    STOP                                   return

Requests are served strictly in the order they arrive, so the trainer alone decides what runs when (sync:
generate, then weights after the update; one step asynchronous: the next step's prompts go out before the
update, the new weights after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scalerl.comm.weights.channel import serve_broadcast
from scalerl.comm.weights.sender import ROLLOUT_DTYPES
from scalerl.models.load import load_model_and_tokenizer
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import GenerationOutput, SamplingParams
from scalerl.rollout.messages import recv_tensors, send_tensors
from scalerl.rollout.weight_loading import engine_weight_receiver

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


def encode_output(out: GenerationOutput) -> list[torch.Tensor]:
    stopped = torch.tensor([r == "stop" for r in out.finish_reasons], dtype=torch.bool)
    return [out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, out.logprobs, stopped]


def decode_output(message: list[torch.Tensor]) -> GenerationOutput:
    prompt_ids, prompt_mask, response_ids, response_mask, logprobs, stopped = message
    return GenerationOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                            ["stop" if s else "length" for s in stopped.tolist()])


@dataclass
class WorkerStats:
    requests: int = 0
    weight_loads: int = 0


class RolloutWorker:
    """Serves generation for the trainer with a model it owns (`serve` returns at STOP)."""

    def __init__(self, cfg: Any, device: torch.device, sync_group, driver_rank: int = 0):
        model, tokenizer = load_model_and_tokenizer(cfg.model, cfg.trainer.init_from, device, cfg.trainer.seed)
        self.model = model.to(ROLLOUT_DTYPES[cfg.rollout.dtype]).eval().requires_grad_(False)
        self.engine = BuiltinEngine(self.model, tokenizer.pad_token_id)
        self.device, self.driver, self.sync_group = device, driver_rank, sync_group
        self.receiver = engine_weight_receiver(self.engine, shadow_device=device)
        self.timeout_s = float(getattr(cfg.trainer, "dist_timeout_s", 600))
        self.stats = WorkerStats()

    def serve(self) -> WorkerStats:
        while True:
            message = recv_tensors(self.driver, device=self.device)
            op = int(message[0][0])
            if op == OP_GENERATE:
                sampling, prompts = decode_request(message)
                out = self.engine.generate(prompts, sampling)
                send_tensors(encode_output(out), self.driver, device=self.device)
                self.stats.requests += 1
            elif op == OP_WEIGHTS:
                serve_broadcast(self.receiver.handle, self.sync_group, self.driver, self.device, self.timeout_s)
                self.stats.weight_loads += 1
            elif op == OP_STOP:
                return self.stats
            else:
                raise RuntimeError(f"rollout worker: unknown request {op} from rank {self.driver}")
