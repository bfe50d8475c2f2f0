"""A standalone rollout worker: a rank outside the trainer's mesh with its own copy of the policy (in
``rollout.dtype``; in a vLLM engine with ``rollout.engine=vllm``), serving the trainer's requests until told
to stop (the requests and their encodings: `scalerl.rollout.worker.protocol`).

Two ways to serve:

- in order (``rollout.partial=false``, the default): each GENERATE is generated whole by the engine's
  fixed batch, then answered; a WEIGHTS is read once the requests before it are answered, so every response
  comes from one set of weights. Deterministic for a fixed seed.
- streaming (``rollout.partial=true``): a `StreamingEngine` (continuous batching) decodes the rows of every
  GENERATE read so far together. Between two engine steps the worker looks at what the trainer sent without
  blocking (a thread reads the messages as they come: `MessageInbox`): a GENERATE's rows join the engine's
  queue; a WEIGHTS is loaded at once, without waiting for the rows in flight, which go on from where they are
  with the new weights. Their KV cache is kept, not recomputed: the keys and values of the tokens so far stay
  those of the weights that produced them (PipelineRL's in-flight weight update) rather than a prefill of
  prompt + prefix with the new weights (AReaL's interruption); a re-prefill per push would cost every row in
  flight a prefill of its whole context, a push every step makes that a large share of generation, and the
  tokens it changes are off-policy either way: each token's policy version and log-prob are those of what
  sampled it, so the correction (rollout.is_*) and the staleness bound see exactly what happened. A GENERATE
  is answered as soon as all its rows finished, so replies may overtake each other; each says which step and
  rows it answers.

With ``rollout.agent.env`` a GENERATE's rows are agent episodes: the worker builds the environment from the
config and runs `scalerl.rollout.agent.loop.AgentLoop` on a continuous engine over its weights (in order: one
request's episodes at a time, weights loaded between requests; streaming: before each engine step of the
episodes the trainer's messages are read, so a push lands while trajectories are in flight and their later turns
carry the new version), and answers with the trajectories (`_serve_agent_streaming`).

Every generated token is tagged with the policy version of the weights that sampled it (the version of the
last WEIGHTS loaded), so one streamed response may mix versions. Answers go without waiting for the trainer
to read them, and each reports how long the worker sat idle before it.
"""

from __future__ import annotations

import queue
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from scalerl.comm.weights.channel import serve_broadcast
from scalerl.core.device import PRECISION_DTYPES
from scalerl.core.errors import UserError
from scalerl.models.load import load_model_and_tokenizer
from scalerl.models.lora import apply_lora_from_config
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.choice import decide_engine
from scalerl.rollout.engines.continuous import GenerationRequest, RequestOutput
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams, left_pad
from scalerl.rollout.engines.weight_loading import engine_weight_receiver
from scalerl.rollout.sources import workers_compute_dtype
from scalerl.rollout.worker.messages import (
    MAX_PENDING_SENDS,
    PendingSend,
    isend_tensors,
    recv_tensors,
)
from scalerl.rollout.worker.protocol import (
    OP_GENERATE,
    OP_PUSH_DIRECT,
    OP_STOP,
    OP_WEIGHTS,
    decode_request,
    encode_reply,
    request_op,
    request_rows,
    serve_point_to_point,
    token_versions,
)


class StreamingEngine(Protocol):
    """What a streaming worker generates with (``rollout.partial=true``): requests in, outputs as they
    finish, weights loadable between two ``step()`` calls while requests are in flight (they continue with
    the new weights). The built-in `scalerl.rollout.engines.continuous.ContinuousEngine` behind
    `BuiltinStreamingEngine`; with rollout.engine=vllm, `scalerl.rollout.engines.vllm_async`'s."""

    # The policy version every token sampled from now on records (`RequestOutput.weight_versions`); the
    # worker sets it after each weight load.
    weight_version: int

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; it starts at a later ``step()``."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run a few decode steps (admitting queued requests into free slots); the requests that finished."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is queued or decoding."""
        ...

    def abort(self, request_ids: Iterable[int]) -> int:
        """Drop these requests, queued or in flight; how many were dropped."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load whole tensors by trainer name (the weight receiver's interface,
        `scalerl.rollout.engines.weight_loading`); returns the bytes loaded."""
        ...


class BuiltinStreamingEngine:
    """The built-in engine streaming: a `ContinuousEngine` over a `BuiltinEngine`'s model, whose parameters
    the weight receiver writes in place (`named_weights`)."""

    def __init__(self, engine: BuiltinEngine, max_prompt_len: int, max_new_tokens: int, max_num_seqs: int):
        self.builtin = engine
        self.continuous = engine.continuous_engine(max_prompt_len, max_new_tokens, max_num_seqs)
        self.device = self.continuous.device
        self.submit, self.step = self.continuous.submit, self.continuous.step
        self.has_unfinished, self.abort = self.continuous.has_unfinished, self.continuous.abort
        self.load_weights, self.named_weights = engine.load_weights, engine.named_weights

    @property
    def weight_version(self) -> int:
        return self.continuous.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.continuous.weight_version = version

    def refresh_weights(self) -> None:
        """After a load into the parameters: any decode layout of the continuous engine laid out again."""
        getattr(self.continuous, "refresh_weights", lambda: None)()


def streaming_engine(cfg: Any, model: torch.nn.Module, pad_token_id: int, scratch_dir: Path,
                     engine: str = "builtin") -> StreamingEngine:
    """The streaming engine of a ``rollout.partial=true`` worker: the built-in continuous-batching engine, or
    with rollout.engine=vllm, vLLM's asynchronous engine (`scalerl.rollout.engines.vllm_async`) started on
    ``trainer.init_from`` / ``model.path`` or ``model``'s weights saved under ``scratch_dir``. Up to
    ``rollout.max_num_seqs`` rows decode at once (0: one step's rows, trainer.batch_size x rollout.n)."""
    r = cfg.rollout
    rows = r.max_num_seqs or cfg.trainer.batch_size * r.n
    if engine == "vllm":
        try:
            from scalerl.rollout.engines.vllm_async import streaming_vllm_engine
        except ImportError as e:
            raise UserError(f"rollout.partial=true with rollout.engine=vllm needs vLLM's asynchronous engine "
                            f"(scalerl.rollout.engines.vllm_async), which did not import: {e}; use "
                            "rollout.engine=builtin or rollout.partial=false") from e
        from scalerl.rollout.engines.vllm import vllm_start_weights

        with vllm_start_weights(model, cfg, scratch_dir) as source:
            return streaming_vllm_engine(cfg, source, pad_token_id)
    return BuiltinStreamingEngine(BuiltinEngine(model, pad_token_id), cfg.data.max_prompt_length, r.max_new_tokens,
                                  rows)


class _StopServing(Exception):
    """A STOP read while an agent worker's episodes ran: they end, and the worker returns."""


class _PollingEngine:
    """An agent worker's continuous engine with ``between_steps()`` called before each ``step()`` (in the
    episodes' engine thread, between two steps: a weight load there changes nothing mid-step)."""

    def __init__(self, engine: Any, between_steps):
        self.engine, self.between_steps = engine, between_steps

    def step(self) -> list[RequestOutput]:
        self.between_steps()
        return self.engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class _ReceivingView:
    """The weight receiver's interface over a streaming engine: in place where it exposes its tensors."""

    def __init__(self, engine):
        self.engine = engine
        self.layer_groups = getattr(engine, "layer_groups", None)  # vLLM reloads whole layers

    def load_weights(self, named_tensors):
        return self.engine.load_weights(named_tensors)

    def named_weights(self):
        return getattr(self.engine, "named_weights", lambda: None)()


class MessageInbox:
    """The trainer's messages, read by a thread as they arrive, so the serving loop can look between engine
    steps without blocking: gloo's ``irecv`` cannot be polled (its work completes only inside ``wait``). The
    thread reads until STOP or an error (each read bounded by the process group's timeout); `get` waits at
    most the seconds it is given."""

    def __init__(self, src: int, device: torch.device):
        self.src, self.device = src, device
        self.messages: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._read, name="rollout-worker-inbox", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                message = recv_tensors(self.src, device=self.device)
            except Exception as e:  # raised on the serving thread by `get`
                self.messages.put(e)
                return
            self.messages.put(message)
            if request_op(message) == OP_STOP:
                return

    def get(self, wait_s: float = 0.0) -> list[torch.Tensor] | None:
        """The next message, or None if none came within ``wait_s`` seconds (0: only one already here)."""
        try:
            item = self.messages.get(timeout=wait_s) if wait_s > 0 else self.messages.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise RuntimeError(f"rollout worker: reading the trainer's (rank {self.src}) messages failed: {item}") from item
        return item


@dataclass
class _OpenRequest:
    """A GENERATE whose rows are in the streaming engine: what its reply needs."""

    step: int
    row_start: int
    prompts: list[list[int]]
    first_id: int  # its rows are the engine's requests first_id .. first_id + len(prompts)
    submitted: float
    outputs: list[RequestOutput | None] = field(default_factory=list)
    remaining: int = 0


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
        self.model = model.to(PRECISION_DTYPES[cfg.rollout.dtype]).eval().requires_grad_(False)
        # rollout.engine=auto decided as the trainer decides it (`decide_engine`: the same inputs)
        self.engine_choice = decide_engine(cfg, model, dist.get_world_size() if dist.is_initialized() else 1)
        self.scratch = None
        self.partial = bool(getattr(cfg.rollout, "partial", False))
        agent = bool(getattr(cfg.rollout.agent, "env", None))
        if self.partial and not (agent and self.engine_choice.name == "builtin"):
            self.scratch = tempfile.TemporaryDirectory(prefix="scalerl_stream_worker_")
            self.engine = streaming_engine(cfg, self.model, tokenizer.pad_token_id, Path(self.scratch.name),
                                           self.engine_choice.name)
        elif self.engine_choice.name == "vllm":
            # vLLM holds its own copy, fed through the shadow copy of `engine_weight_receiver`; the first push
            # (and the first after a restart, when this worker reports no verified version) is a full one.
            from scalerl.rollout.engines.vllm import vllm_engine_from_config

            self.scratch = tempfile.TemporaryDirectory(prefix="scalerl_vllm_worker_")
            self.engine = vllm_engine_from_config(self.model, cfg, Path(self.scratch.name), tokenizer.pad_token_id)
            self.model = None
        else:
            self.engine = BuiltinEngine(self.model, tokenizer.pad_token_id, max_num_seqs=cfg.rollout.max_num_seqs,
                                        dtype=workers_compute_dtype(cfg.rollout.dtype, cfg.trainer.precision))
        self.pad_token_id = tokenizer.pad_token_id
        self.device, self.driver, self.sync_group = device, driver_rank, sync_group
        self.receiver = engine_weight_receiver(_ReceivingView(self.engine) if self.partial else self.engine,
                                               shadow_device=device)
        self.timeout_s = float(getattr(cfg.trainer, "dist_timeout_s", 600))
        self.stats = WorkerStats()
        self.version = 0  # the policy version of the weights it holds (the trainer's, from WEIGHTS)
        self.push_direct = False  # whether pushes come point to point (after another worker died)
        # rollout.agent.env: each GENERATE's rows are episodes (`AgentLoop`) on a continuous engine over this
        # worker's weights (a streaming vLLM engine is one already; the others make one, sized for a whole
        # trajectory), answered as trajectories with their loss mask, per-segment versions and env rewards.
        self.agent, self.agent_engine = None, None
        if agent:
            from scalerl.rollout.agent.source import agent_limits, agent_loop

            r = cfg.rollout
            make = getattr(self.engine, "continuous_engine", None)
            self.agent_engine = self.engine if make is None else make(
                agent_limits(cfg).max_total_tokens, r.max_new_tokens, r.max_num_seqs or cfg.trainer.batch_size * r.n)
            self.agent = agent_loop(cfg, tokenizer, self.agent_engine)

    def serve(self) -> WorkerStats:
        if self.agent is not None and self.partial:
            return self._serve_agent_streaming()
        return self._serve_streaming() if self.partial else self._serve_in_order()

    def _generate(self, message: list[torch.Tensor], between_steps=None
                  ) -> tuple[GenerationOutput, SamplingParams, dict[str, float] | None]:
        """A GENERATE's output: the engine's responses, or an agent run's episodes (then with their
        ``agent/*`` metrics); ``between_steps`` is called before each engine step of the episodes."""
        sampling, prompts = decode_request(message)
        if self.agent is None:
            out = self.engine.generate(prompts, sampling)
            if out.weight_versions is None:
                out.weight_versions = token_versions(out.response_mask, self.version)
            return out, sampling, None
        from scalerl.rollout.agent.loop import agent_metrics
        from scalerl.rollout.trajectory import trajectories_to_output

        rows = request_rows(message)
        if rows is None or len(rows) != len(prompts):
            raise RuntimeError(f"rollout worker: an agent run's GENERATE needs one data row per prompt row (got "
                               f"{0 if rows is None else len(rows)} for {len(prompts)}): a trainer of another "
                               "rollout.agent setting?")
        self.agent.engine = self.agent_engine if between_steps is None else _PollingEngine(self.agent_engine,
                                                                                         between_steps)
        began = time.perf_counter()
        trajectories, records = self.agent.run(rows, sampling, row_offset=sampling.row_offset,
                                               total_rows=sampling.total_rows or sampling.row_offset + len(rows))
        metrics = agent_metrics(records, trajectories, time.perf_counter() - began)
        return trajectories_to_output(trajectories, self.pad_token_id), sampling, metrics

    def _serve_in_order(self) -> WorkerStats:
        replies: deque[PendingSend] = deque()
        idle = 0.0  # since the last answer
        while True:
            start = time.perf_counter()
            message = recv_tensors(self.driver, device=self.device)
            idle += time.perf_counter() - start
            op = request_op(message)
            if op == OP_GENERATE:
                start = time.perf_counter()
                out, sampling, metrics = self._generate(message)
                reply = encode_reply(out, int(message[0][1]), idle, time.perf_counter() - start, sampling.row_offset,
                                     metrics)
                self._answer(replies, reply)
                self.stats.idle_s += idle
                idle = 0.0
            elif op == OP_WEIGHTS:
                idle += self._load_weights(int(message[0][1]))
            elif op == OP_PUSH_DIRECT:
                self.push_direct = True
            elif op == OP_STOP:
                return self._stop(replies)
            else:
                raise RuntimeError(f"rollout worker: unknown request {op} from rank {self.driver}")

    def _serve_streaming(self) -> WorkerStats:
        """Each round: read every message already here (waiting, bounded, only when the engine is empty), up
        to a WEIGHTS; one engine step; then that WEIGHTS, loaded between two steps. So the rows of a GENERATE
        read before a WEIGHTS start with the older weights, and one read after it starts with the newer."""
        inbox = MessageInbox(self.driver, self.device)
        replies: deque[PendingSend] = deque()
        rows: dict[int, tuple[_OpenRequest, int]] = {}  # engine request id -> (its GENERATE, row index)
        next_id, idle = 0, 0.0
        while True:
            weights = None
            while weights is None:
                busy = self.engine.has_unfinished()
                start = time.perf_counter()
                message = inbox.get(0.0 if busy else self.timeout_s)
                if not busy:
                    idle += time.perf_counter() - start
                    if message is None:
                        raise RuntimeError(f"rollout worker: no request from the trainer (rank {self.driver}) within "
                                           f"{self.timeout_s:.0f} s (trainer.dist_timeout_s)")
                if message is None:
                    break
                op = request_op(message)
                if op == OP_GENERATE:
                    request = self._submit(message, next_id)
                    rows.update({request.first_id + i: (request, i) for i in range(len(request.prompts))})
                    next_id += len(request.prompts)
                elif op == OP_WEIGHTS:
                    weights = message
                elif op == OP_PUSH_DIRECT:
                    self.push_direct = True
                elif op == OP_STOP:
                    self.engine.abort(list(rows))  # what the trainer no longer needs (a run's last steps ahead)
                    return self._stop(replies)
                else:
                    raise RuntimeError(f"rollout worker: unknown request {op} from rank {self.driver}")
            if self.engine.has_unfinished():
                for output in self.engine.step():
                    request, i = rows.pop(output.request_id)
                    request.outputs[i] = output
                    request.remaining -= 1
                    if not request.remaining:
                        out = assemble_output(request.prompts, request.outputs, self.pad_token_id)
                        reply = encode_reply(out, request.step, idle, time.perf_counter() - request.submitted,
                                             request.row_start)
                        self._answer(replies, reply)
                        self.stats.idle_s += idle
                        idle = 0.0
            if weights is not None:
                idle += self._load_weights(int(weights[0][1]))

    def _serve_agent_streaming(self) -> WorkerStats:
        """An agent worker with rollout.partial=true: each GENERATE's episodes run together (one at a time),
        and before every engine step the messages that came are read (`MessageInbox`): a WEIGHTS is loaded
        there, the trajectories in flight going on with the new weights (each turn's tokens keep the version
        that sampled them: a trajectory spanning a push keeps its per-segment versions), a GENERATE waits for
        the episodes before it, a STOP ends them."""
        inbox = MessageInbox(self.driver, self.device)
        replies: deque[PendingSend] = deque()
        later: deque[list[torch.Tensor]] = deque()  # GENERATEs read while episodes ran, in order

        def between_steps() -> None:
            while (message := inbox.get(0.0)) is not None:
                op = request_op(message)
                if op == OP_WEIGHTS:
                    self._load_weights(int(message[0][1]))
                elif op == OP_PUSH_DIRECT:
                    self.push_direct = True
                elif op == OP_STOP:
                    raise _StopServing()
                elif op == OP_GENERATE:
                    later.append(message)
                else:
                    raise RuntimeError(f"rollout worker: unknown request {op} from rank {self.driver}")

        idle = 0.0
        while True:
            if later:
                message = later.popleft()
            else:
                start = time.perf_counter()
                message = inbox.get(self.timeout_s)
                idle += time.perf_counter() - start
                if message is None:
                    raise RuntimeError(f"rollout worker: no request from the trainer (rank {self.driver}) within "
                                       f"{self.timeout_s:.0f} s (trainer.dist_timeout_s)")
            op = request_op(message)
            if op == OP_GENERATE:
                start = time.perf_counter()
                try:
                    out, sampling, metrics = self._generate(message, between_steps)
                except _StopServing:  # what the trainer no longer needs (a run's last steps ahead)
                    return self._stop(replies)
                reply = encode_reply(out, int(message[0][1]), idle, time.perf_counter() - start, sampling.row_offset,
                                     metrics)
                self._answer(replies, reply)
                self.stats.idle_s += idle
                idle = 0.0
            elif op == OP_WEIGHTS:
                idle += self._load_weights(int(message[0][1]))
            elif op == OP_PUSH_DIRECT:
                self.push_direct = True
            elif op == OP_STOP:
                return self._stop(replies)
            else:
                raise RuntimeError(f"rollout worker: unknown request {op} from rank {self.driver}")

    def _submit(self, message: list[torch.Tensor], first_id: int) -> _OpenRequest:
        """A GENERATE's rows into the engine's queue, row ``i`` with the draws of the step's row
        ``row_offset + i`` (as the fixed batch's), so a row's sample never depends on what shares the batch."""
        sampling, prompts = decode_request(message)
        draws = row_draws(sampling, len(prompts), getattr(self.engine, "device", None))
        for i, prompt in enumerate(prompts):
            row = replace(sampling, row_offset=sampling.row_offset + i)
            self.engine.submit(GenerationRequest(first_id + i, prompt, row, None if draws is None else draws[:, i]))
        return _OpenRequest(int(message[0][1]), sampling.row_offset, prompts, first_id, time.perf_counter(),
                            [None] * len(prompts), len(prompts))

    def _load_weights(self, version: int) -> float:
        """Receive a weight sync (every tensor verified) and generate with ``version`` from now on; the seconds.
        A push cut short by another worker's death leaves the version as it was (what was written is
        unverified, and the trainer's next push, over the live workers, finds it so and resends it)."""
        start = time.perf_counter()
        try:
            if self.push_direct:  # another worker died: pushes come point to point
                serve_point_to_point(self.receiver.handle, self.driver, self.device)
            else:
                serve_broadcast(self.receiver.handle, self.sync_group, self.driver, self.device, self.timeout_s)
        except RuntimeError as e:  # WeightSyncError is one
            print(f"warning: rollout worker: the weight push of version {version} failed ({e}); generating with "
                  f"version {self.version} until the next push", file=sys.stderr, flush=True)
            self.receiver.version = 0  # partly written: the next push must be a full one
            return time.perf_counter() - start
        if hasattr(self.engine, "refresh_weights"):  # the built-in decode layout of the new weights;
            self.engine.refresh_weights()  # vLLM's loads already went into its own layout
        self.version = version
        if self.agent_engine is not None:  # its tokens from now on record the new version
            getattr(self.agent_engine, "refresh_weights", lambda: None)()
            self.agent_engine.weight_version = version
        elif self.partial:
            self.engine.weight_version = version
        self.stats.weight_loads += 1
        return time.perf_counter() - start

    def _answer(self, replies: deque[PendingSend], reply: list[torch.Tensor]) -> None:
        replies.append(isend_tensors(reply, self.driver, device=self.device))
        while replies and (replies[0].done() or len(replies) > MAX_PENDING_SENDS):
            replies.popleft().wait()
        self.stats.requests += 1

    def _stop(self, replies: deque[PendingSend]) -> WorkerStats:
        while replies:
            replies.popleft().wait()
        self.close()
        return self.stats

    def close(self) -> None:
        """Stop a vLLM engine's child process and remove its initial weights."""
        getattr(self.engine, "close", lambda: None)()
        if self.scratch is not None:
            self.scratch.cleanup()


def row_draws(sampling: SamplingParams, rows: int, device: torch.device | None) -> torch.Tensor | None:
    """``[max_new_tokens, rows]`` uniforms of the step's rows ``row_offset ..`` from ``sampling.seed``, drawn
    as the fixed-batch engine draws them (all ``total_rows`` at once, on the engine's device); None where the
    engine draws for itself (greedy, no seed, an engine that takes no draws)."""
    if device is None or sampling.seed is None or sampling.temperature == 0:
        return None
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    total = sampling.total_rows or sampling.row_offset + rows
    uniforms = torch.rand(sampling.max_new_tokens, total, device=device, generator=generator)
    return uniforms[:, sampling.row_offset : sampling.row_offset + rows]


def assemble_output(prompts: Sequence[Sequence[int]], outputs: Sequence[RequestOutput],
                    pad_token_id: int) -> GenerationOutput:
    """Finished requests, row ``i`` answering prompt ``i``, as one generation output (prompts left-padded,
    responses right-padded; each token's policy version kept, -1 on padding)."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    n, width = len(outputs), max(o.token_ids.numel() for o in outputs)
    response_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.int32)
    for i, o in enumerate(outputs):
        k = o.token_ids.numel()
        response_ids[i, :k], response_mask[i, :k] = o.token_ids.cpu(), 1
        logprobs[i, :k], versions[i, :k] = o.logprobs.float().cpu(), o.weight_versions.to(torch.int32).cpu()
    return GenerationOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                            [o.finish_reason for o in outputs], versions)

