"""What the trainer and its standalone rollout workers say to each other: the requests, their encodings, and
the trainer's end of the conversation, counted.

The trainer's rank 0 drives every worker with tensor messages (`scalerl.rollout.worker.messages`, no pickle):

    GENERATE  -> (step, sampling, prompts)  reply: the generation output of those rows, every token's policy
                                            version, the step and row range it answers, and the worker's idle
                                            time before it (`WorkerReply`); in an agent run (rollout.agent.env)
                                            the request adds the rows' data (JSON), the reply the trajectories'
                                            loss mask, environment rewards and the worker's agent/* metrics
    WEIGHTS   -> (version) a weight sync    the worker then receives it (`scalerl.comm.weights`: buckets
                                            broadcast over the trainer's rank 0 + workers group, verified,
                                            deltas after the first) and generates with ``version`` from then on
    STOP                                    the worker returns
    PUSH_DIRECT  after a worker died        later pushes come point to point from rank 0 (`PointToPointChannel`)
                                            instead of over the group that includes the dead worker

A worker serves requests strictly in the order they arrive, so the order the trainer sends them in decides
which weights generate what: a GENERATE sent after WEIGHTS(v) is generated with version v. With
``rollout.partial=true`` a worker streams (`scalerl.rollout.worker.worker`): the rows of every GENERATE it has read
decode together, a WEIGHTS lands between two engine steps and the rows in flight go on with the new weights
(a GENERATE sent after WEIGHTS(v) still starts with v), and each GENERATE is answered once all its rows
finished, so replies may come out of order: each names its step and rows, and the driver matches it to
what it owes (`WorkerDriver.collect`). Both ends send
without waiting for the other to read (`isend_tensors`): the trainer queues requests for the steps it runs
ahead (`rollout.staleness`), a worker answers and goes on to its next request. Requests go to the worker
with the fewest tokens in flight (`WorkerDriver.least_loaded`); a worker that dies is named and its requests
go again to the live workers (`WorkerDriver`); the run stops, naming them, when none is left
(`RolloutWorkerError`). A generation output also travels among the trainer's ranks in the same
encoding (`broadcast_output`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scalerl.comm.weights.channel import Ack, Kind, Message, WeightSyncError
from scalerl.core.errors import UserError
from scalerl.parallel.distributed import DistContext
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams
from scalerl.rollout.worker.messages import (
    MAX_PENDING_SENDS,
    PendingSend,
    broadcast_tensors,
    isend_tensors,
    recv_tensors,
    recv_tensors_from_any,
    send_tensors,
)

OP_GENERATE, OP_WEIGHTS, OP_STOP, OP_PUSH_DIRECT = 1, 2, 3, 4
PUSH_TAG = 1  # weight-push messages sent point to point: a stream apart from requests and replies (tag 0)


def encode_request(step: int, sampling: SamplingParams, prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                   rows: list[dict] | None = None):
    """A GENERATE request: the command, sampling parameters, stop tokens and left-padded prompts; for an agent
    run (rollout.agent.env) also the data rows its episodes start from, one per prompt row, as JSON."""
    params = torch.tensor([sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
                           -1 if sampling.seed is None else sampling.seed, sampling.row_offset,
                           sampling.total_rows or 0], dtype=torch.float64)
    stop = torch.tensor(list(sampling.stop_token_ids) or [-1], dtype=torch.int64)
    message = [torch.tensor([OP_GENERATE, step]), params, stop, prompt_ids, prompt_lengths]
    return message if rows is None else [*message, json_tensor(rows, "the data rows of an agent run's episodes")]


def request_rows(message: list[torch.Tensor]) -> list[dict] | None:
    """A GENERATE's data rows (one per prompt row), or None where it carries none (a single-turn run)."""
    return from_json_tensor(message[5]) if len(message) > 5 else None


def json_tensor(value, what: str) -> torch.Tensor:
    """``value`` as the UTF-8 bytes of its JSON (a uint8 tensor): data rows and metrics travel so, never
    pickled. A value JSON cannot hold is refused, naming ``what`` it was."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        raise UserError(f"{what} must be JSON (strings, numbers, lists, dicts) to reach the standalone rollout "
                        f"workers: {e}; convert the dataset's columns to plain values, or run "
                        "rollout.placement=colocated") from e
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def from_json_tensor(tensor: torch.Tensor):
    """The value `json_tensor` sent."""
    return json.loads(tensor.cpu().numpy().tobytes().decode())


def decode_request(message: list[torch.Tensor]) -> tuple[SamplingParams, list[list[int]]]:
    _, params, stop, prompt_ids, lengths = message[:5]
    max_new, temperature, top_p, top_k, seed, row_offset, total_rows = params.tolist()
    sampling = SamplingParams(
        max_new_tokens=int(max_new), temperature=temperature, top_p=top_p, top_k=int(top_k),
        stop_token_ids=[t for t in stop.tolist() if t >= 0], seed=None if seed < 0 else int(seed),
        row_offset=int(row_offset), total_rows=int(total_rows) or None,
    )
    width = prompt_ids.shape[1]
    return sampling, [row[width - n :] for row, n in zip(prompt_ids.tolist(), lengths.tolist())]


# Dimensions of the tensors `encode_output` sends: prompt ids and mask, response ids and mask, log-probs, stopped,
# every token's policy version.
OUTPUT_TENSOR_DIMS = (2, 2, 2, 2, 2, 1, 2)


def encode_output(out: GenerationOutput) -> list[torch.Tensor]:
    """The output's tensors; tokens whose version is unknown (no ``weight_versions``) carry -1. Multi-turn
    trajectories add their loss mask and each row's environment reward (NaN: the environment gave none, the
    run's reward function scores the row)."""
    stopped = torch.tensor([r == "stop" for r in out.finish_reasons], dtype=torch.bool)
    versions = out.weight_versions if out.weight_versions is not None else torch.full(
        out.response_ids.shape, -1, dtype=torch.int32)
    message = [out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, out.logprobs, stopped,
               versions.to(torch.int32)]
    if out.loss_mask is None and out.reward_inputs is None:
        return message
    loss_mask = out.response_mask if out.loss_mask is None else out.loss_mask  # a multi-turn trajectory's mask
    if out.reward_inputs is None:
        return [*message, loss_mask]
    given = [(r or {}).get("env_reward") for r in out.reward_inputs]
    rewards = torch.tensor([math.nan if g is None else float(g) for g in given], dtype=torch.float64)
    return [*message, loss_mask, rewards]


def decode_output(message: list[torch.Tensor]) -> GenerationOutput:
    prompt_ids, prompt_mask, response_ids, response_mask, logprobs, stopped, versions, *extra = message
    reward_inputs = None
    if len(extra) > 1:
        reward_inputs = [{} if math.isnan(v) else {"env_reward": v} for v in extra[1].tolist()]
    return GenerationOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                            ["stop" if s else "length" for s in stopped.tolist()], versions,
                            extra[0] if extra else None, reward_inputs)


def token_versions(response_mask: torch.Tensor, version: int) -> torch.Tensor:
    """Every generated token tagged with ``version`` (-1 on padding): an engine that decodes a whole
    response with one set of weights."""
    return torch.where(response_mask.bool(), version, -1).to(torch.int32)


@dataclass
class WorkerReply:
    """A worker's answer to one GENERATE: the output, the step it was for, and the seconds the worker had
    been idle (waiting for requests or weights, receiving them included) before it started generating."""

    out: GenerationOutput
    step: int
    idle_s: float
    gen_s: float
    row_start: int  # the step's rows it answers: row_start .. row_start + len(out) (the request's row_offset)
    metrics: dict[str, float] = field(default_factory=dict)  # an agent worker's ``agent/*`` of these rows


def encode_reply(out: GenerationOutput, step: int, idle_s: float, gen_s: float, row_start: int,
                 metrics: dict[str, float] | None = None) -> list[torch.Tensor]:
    """The output, then (where given) the metrics as JSON, then ``[step, idle_s, gen_s, row_start, has
    metrics]``."""
    trailer = torch.tensor([step, idle_s, gen_s, row_start, float(metrics is not None)], dtype=torch.float64)
    extra = [] if metrics is None else [json_tensor(metrics, "the agent metrics")]
    return [*encode_output(out), *extra, trailer]


def decode_reply(message: list[torch.Tensor]) -> WorkerReply:
    step, idle_s, gen_s, row_start, has_metrics = message[-1].tolist()
    if has_metrics:
        return WorkerReply(decode_output(message[:-2]), int(step), idle_s, gen_s, int(row_start),
                           from_json_tensor(message[-2]))
    return WorkerReply(decode_output(message[:-1]), int(step), idle_s, gen_s, int(row_start))


class RolloutWorkerError(UserError, RuntimeError):
    """A rollout worker stopped answering (its process died, or its link): names the rank and what it owed."""


def request_op(message: list[torch.Tensor]) -> int:
    """The command of a request (its first tensor is ``[op, step]``)."""
    return int(message[0][0])


class WorkerDriver:
    """The trainer's rank 0 end: requests to the workers and their replies, each send counted (``rollout``
    or ``weight_sync`` traffic, a point-to-point send of its payload) and timed; the tokens each worker has
    in flight (requested, not yet received: prompt + the response limit per row).

    A worker that stops answering (its process died, or its link) is named in the log and counted
    (``dead``); the requests it owed go again, as sent, to the least-loaded live worker (a row's draws are
    tied to its step row, so the re-issued rows sample what they would have), and the weight pushes from
    then on go point to point to the live workers (`push_channel`). The run stops, naming them, only when no worker
    is left. (A worker cannot rejoin a running job's process group; a job restarted by its launcher starts
    every worker again, and each gets a full push: it reports no verified version.)"""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.workers = list(ctx.rollout_ranks)  # the live ones
        self.dead: dict[int, str] = {}  # rank -> what failed
        # (step, first row) -> (tokens, the request as sent), per worker
        self.owed: dict[int, dict[tuple[int, int], tuple[int, list[torch.Tensor]]]] = {w: {} for w in self.workers}
        self.arrived: dict[tuple[int, int], WorkerReply] = {}  # replies read before they were asked for
        self.sends: deque[tuple[int, PendingSend]] = deque()  # (worker, send)
        self.direct: PointToPointChannel | None = None  # the pushes' channel after a death

    def tokens_in_flight(self, worker: int) -> int:
        return sum(tokens for tokens, _ in self.owed[worker].values())

    def least_loaded(self) -> int:
        """The worker with the fewest tokens in flight (the lowest rank among equals)."""
        return min(self.workers, key=lambda w: (self.tokens_in_flight(w), w))

    def request_generation(self, worker: int, step: int, sampling: SamplingParams, prompt_ids: torch.Tensor,
                           prompt_lengths: torch.Tensor, tokens: int = 0, rows: list[dict] | None = None) -> None:
        """Rows ``sampling.row_offset`` on of ``step`` to ``worker`` (one part per step and first row); ``rows``:
        an agent run's data rows, one per prompt row."""
        message = encode_request(step, sampling, prompt_ids, prompt_lengths, rows)
        self.owed[worker][(step, sampling.row_offset)] = (tokens, message)  # first: re-issued if the send fails
        self._send("rollout", message, worker)

    def collect(self, step: int, row_start: int) -> WorkerReply:
        """The reply to the part of ``step`` from row ``row_start``, from whichever worker owes it now: read
        when it comes, replies to other parts that come first kept for their turn (a streaming worker
        answers as rows finish)."""
        part = (step, row_start)
        while part not in self.arrived:
            owner = next((w for w in self.workers if part in self.owed[w]), None)
            if owner is None:
                raise RuntimeError(f"no rollout worker owes step {step} from row {row_start}")
            self.receive(owner)
        return self.arrived.pop(part)

    def collect_first(self, step: int, row_starts: set[int]) -> WorkerReply:
        """The first to arrive of the replies to ``step``'s parts from ``row_starts`` (the streaming trainer's
        read): a reply already kept is taken at once (the lowest row first); else the next reply from whichever
        worker sends first is read (`recv_tensors_from_any`: on a single trainer rank, the streaming trainer's
        layout, only workers send to rank 0) and kept, and the loop looks again. Where only one worker owes them, or a
        receive from any worker fails (a dead worker cannot be named from it), it reads as `collect` does,
        from the owner of the lowest row, which names a dead worker and re-issues its requests."""
        while True:
            for start in sorted(row_starts):
                if (step, start) in self.arrived:
                    return self.arrived.pop((step, start))
            owners = [w for w in self.workers if any((step, s) in self.owed[w] for s in row_starts)]
            if not owners:
                raise RuntimeError(f"no rollout worker owes step {step} from rows {sorted(row_starts)}")
            if len(owners) > 1 and not self.dead:
                try:
                    src, message = recv_tensors_from_any(device=self.ctx.device)
                except RuntimeError:
                    src = None  # read below from the owners, one at a time, where a dead one is named
                if src is not None:
                    self._keep(src, decode_reply(message))
                    continue
            owner = next((w for w in owners for s in sorted(row_starts) if (step, s) in self.owed[w]), owners[0])
            self.receive(owner)

    def receive(self, worker: int) -> WorkerReply | None:
        """``worker``'s next reply (kept in ``arrived`` too), matched to a part it owes; None when the worker
        turned out dead (what it owed re-issued)."""
        try:
            reply = self._recv(worker)
        except RuntimeError as e:
            self._lost(worker, e)
            return None
        return self._keep(worker, reply)

    def _keep(self, worker: int, reply: WorkerReply) -> WorkerReply:
        """``worker``'s ``reply``, matched to a part it owes and kept in ``arrived``."""
        part = (reply.step, reply.row_start)
        if part not in self.owed[worker]:
            raise RuntimeError(f"rollout worker rank {worker} answered step {reply.step} from row {reply.row_start}, "
                               f"which it does not owe (it owes {sorted(self.owed[worker])})")
        del self.owed[worker][part]
        self.arrived[part] = reply
        return reply

    def _lost(self, worker: int, error: Exception) -> None:
        """``worker`` is dead: named, and its requests re-issued to the live workers (or the run stops)."""
        owed = self.owed.pop(worker)
        steps = sorted({s for s, _ in owed})
        self.workers.remove(worker)
        self.dead[worker] = str(error)
        if not self.workers:
            raise RolloutWorkerError(
                f"rollout workers {sorted(self.dead)} all stopped answering (the last, rank {worker}, owed the "
                f"rollouts of steps {steps}): {error}. Restart the run with trainer.resume=auto (the steps in "
                "flight are generated again)") from error
        moved = []
        for part, (tokens, message) in sorted(owed.items()):
            target = self.least_loaded()
            self.owed[target][part] = (tokens, message)
            moved.append(target)
            self._send("rollout", message, target)
        print(f"warning: rollout worker rank {worker} stopped answering ({str(error).splitlines()[0][:200]}); its "
              f"requests for steps {steps} went again to ranks {sorted(set(moved))}; {len(self.workers)} workers "
              f"left {self.workers}", file=sys.stderr, flush=True)

    def _recv(self, worker: int) -> WorkerReply:
        return decode_reply(recv_tensors(worker, device=self.ctx.device))

    def push_channel(self, broadcast):
        """The channel the next weight push goes over: ``broadcast`` (over rank 0 + every worker) while all
        are alive; after a death, point-to-point messages to the live workers (a process group cannot drop a
        member, and a new one cannot be formed without it), each told once with PUSH_DIRECT, which it reads
        in its request order."""
        if not self.dead:
            return broadcast
        if self.direct is None:
            for worker in list(self.workers):
                self._send("weight_sync", [torch.tensor([OP_PUSH_DIRECT, 0])], worker)
            self.direct = PointToPointChannel(self.workers, self.ctx.device)
        self.direct.workers = list(self.workers)
        return self.direct

    def announce_weights(self, version: int = 0) -> None:
        """Tell every worker a weight sync of ``version`` follows (it then joins the sender's broadcasts)."""
        for worker in list(self.workers):
            self._send("weight_sync", [torch.tensor([OP_WEIGHTS, version])], worker)

    def stop(self) -> None:
        for worker in list(self.workers):
            self._send("rollout", [torch.tensor([OP_STOP, 0])], worker)
        while self.sends:
            worker, pending = self.sends.popleft()
            if worker in self.workers:  # a dead worker's sends never complete
                pending.wait()

    def _send(self, kind: str, tensors: list[torch.Tensor], worker: int) -> int:
        """Send without waiting; a worker whose connection is already known closed is lost here (0 bytes)."""
        if worker in self.dead:
            return 0
        start = time.perf_counter()
        try:
            pending = isend_tensors(tensors, worker, device=self.ctx.device)
        except RuntimeError as e:
            self._lost(worker, e)
            return 0
        self.sends.append((worker, pending))
        while self.sends and (self.sends[0][0] in self.dead or self.sends[0][1].done()
                              or len(self.sends) > MAX_PENDING_SENDS):  # keep a few in flight
            to, oldest = self.sends.popleft()
            if to not in self.dead:  # a dead worker's sends never complete
                oldest.wait()
        self.ctx.comm.record(kind, "send", pending.nbytes, 2, dim="rollout_workers")
        self.ctx.comm.add_wait(kind, time.perf_counter() - start)
        return pending.nbytes


class PointToPointChannel:
    """A weight push's transport to the live workers after one died: each message sent to each worker, each
    answering with its ack (the `scalerl.comm.weights.channel` conversation, unchanged), over the default
    group with `PUSH_TAG`, so the requests and replies between the same ranks are not mixed in. Each send and
    receive has the process group's timeout."""

    def __init__(self, workers: list[int], device: torch.device):
        self.workers, self.device = list(workers), device

    @property
    def num_receivers(self) -> int:
        return len(self.workers)

    def exchange(self, message: Message) -> list[Ack]:
        self._send(message)
        return [Ack.from_tensor(recv_tensors(w, device=self.device, tag=PUSH_TAG)[0].cpu()) for w in self.workers]

    def abort(self, message: Message) -> None:
        self._send(message)

    def _send(self, message: Message) -> None:
        payload = (torch.frombuffer(bytearray(message.payload), dtype=torch.uint8) if message.payload
                   else torch.zeros(0, dtype=torch.uint8))
        sends = [isend_tensors([message.header(), payload], w, device=self.device, tag=PUSH_TAG) for w in self.workers]
        for pending in sends:
            pending.wait()


def serve_point_to_point(handle, src: int, device: torch.device) -> Message:
    """A worker's side of one push over `PointToPointChannel`: answer messages from ``src`` until ``END``
    (returned); raises `WeightSyncError` on ``ABORT``."""
    while True:
        header, payload = recv_tensors(src, device=device, tag=PUSH_TAG)
        message = Message.from_wire(header.cpu(), memoryview(payload.cpu().numpy()).cast("B") if payload.numel()
                                    else b"")
        if message.kind == Kind.ABORT:
            raise WeightSyncError(f"weight sync aborted by the sender (rank {src}), bucket {message.bucket}")
        send_tensors([handle(message).tensor()], src, device=device, tag=PUSH_TAG)
        if message.kind == Kind.END:
            return message


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
