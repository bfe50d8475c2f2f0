"""A standalone rollout worker: a rank outside the trainer's mesh with its own copy of the policy (in
``rollout.dtype``; in a vLLM engine with ``rollout.engine=vllm``), serving the trainer's requests in order until told to stop (the requests and their
encodings: `scalerl.rollout.worker_protocol`).

It tags every generated token with the policy version of the weights it holds (the version of the last
WEIGHTS it received; the engine decodes a whole response with one set of weights), answers without waiting
for the trainer to read the answer, and reports with each answer how long it sat idle before it.
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scalerl.comm.weights.channel import serve_broadcast
from scalerl.comm.weights.sender import ROLLOUT_DTYPES
from scalerl.models.load import load_model_and_tokenizer
from scalerl.models.lora import apply_lora_from_config
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine_choice import resolve_engine
from scalerl.rollout.messages import PendingSend, isend_tensors, recv_tensors
from scalerl.rollout.sources import workers_compute_dtype
from scalerl.rollout.weight_loading import engine_weight_receiver
from scalerl.rollout.worker_protocol import (
    OP_GENERATE,
    OP_STOP,
    OP_WEIGHTS,
    decode_request,
    encode_reply,
    request_op,
    token_versions,
)


@dataclass
class WorkerStats:
    requests: int = 0
    weight_loads: int = 0
    idle_s: float = 0.0  # waiting for requests or weights, receiving them included


class RolloutWorker:
    """Serves generation for the trainer with a model it owns (`serve` returns at STOP)."""

    def __init__(self, cfg: Any, device: torch.device, sync_group, driver_rank: int = 0):
        model, tokenizer = load_model_and_tokenizer(cfg.model, cfg.trainer.init_from, device, cfg.trainer.seed)
        # The trainer's adapted modules, so pushes of its adapters land by name (`synced_tensors`).
        apply_lora_from_config(model, cfg.model.lora, cfg.trainer.seed)
        self.model = model.to(ROLLOUT_DTYPES[cfg.rollout.dtype]).eval().requires_grad_(False)
        self.scratch = None
        if resolve_engine(cfg, model, trainer_ranks=1) == "vllm":
            # vLLM holds its own copy, fed through the shadow copy of `engine_weight_receiver`; the first push
            # (and the first after a restart, when this worker reports no verified version) is a full one.
            from scalerl.rollout.vllm_engine import vllm_engine_from_config

            self.scratch = tempfile.TemporaryDirectory(prefix="scalerl_vllm_worker_")
            self.engine = vllm_engine_from_config(self.model, cfg, Path(self.scratch.name), tokenizer.pad_token_id)
            self.model = None
        else:
            self.engine = BuiltinEngine(self.model, tokenizer.pad_token_id, max_num_seqs=cfg.rollout.max_num_seqs,
                                        dtype=workers_compute_dtype(cfg.rollout.dtype, cfg.trainer.precision))
        self.device, self.driver, self.sync_group = device, driver_rank, sync_group
        self.receiver = engine_weight_receiver(self.engine, shadow_device=device)
        self.timeout_s = float(getattr(cfg.trainer, "dist_timeout_s", 600))
        self.stats = WorkerStats()
        self.version = 0  # the policy version of the weights it holds (the trainer's, from WEIGHTS)

    def serve(self) -> WorkerStats:
        replies: deque[PendingSend] = deque()
        idle = 0.0  # since the last answer
        while True:
            start = time.perf_counter()
            message = recv_tensors(self.driver, device=self.device)
            idle += time.perf_counter() - start
            op = request_op(message)
            if op == OP_GENERATE:
                sampling, prompts = decode_request(message)
                start = time.perf_counter()
                out = self.engine.generate(prompts, sampling)
                if out.weight_versions is None:
                    out.weight_versions = token_versions(out.response_mask, self.version)
                reply = encode_reply(out, int(message[0][1]), idle, time.perf_counter() - start)
                replies.append(isend_tensors(reply, self.driver, device=self.device))
                while replies and replies[0].done():
                    replies.popleft().wait()
                self.stats.requests += 1
                self.stats.idle_s += idle
                idle = 0.0
            elif op == OP_WEIGHTS:
                start = time.perf_counter()
                serve_broadcast(self.receiver.handle, self.sync_group, self.driver, self.device, self.timeout_s)
                if hasattr(self.engine, "refresh_weights"):  # the built-in decode layout of the new weights;
                    self.engine.refresh_weights()  # vLLM's loads already went into its own layout
                self.version = int(message[0][1])
                idle += time.perf_counter() - start
                self.stats.weight_loads += 1
            elif op == OP_STOP:
                while replies:
                    replies.popleft().wait()
                self.close()
                return self.stats
            else:
                raise RuntimeError(f"rollout worker: unknown request {op} from rank {self.driver}")

    def close(self) -> None:
        """Stop a vLLM engine's child process and remove its initial weights."""
        getattr(self.engine, "close", lambda: None)()
        if self.scratch is not None:
            self.scratch.cleanup()
