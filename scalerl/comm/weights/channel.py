"""How weight-sync messages travel: one sender, any number of receivers, one acknowledgement per message.

A sync is a conversation the sender leads: ``HELLO`` (receivers answer with the version and plan they
hold), ``PLAN`` (full pushes only), one ``BUCKET`` per bucket (and again, dense, for a bucket a receiver
could not verify), ``END`` (the new version), or ``ABORT``. Every message is a fixed int64 header and an
optional byte payload; every receiver answers each message with a 4-int64 ack (status, checksum of what
it now holds, version, plan hash), so the sender learns about a failure at the bucket that failed and
can resend it from the bucket it still holds.

Every header carries the sync's number; a HELLO also carries the sender's limit for each later step
(``limit_ms``, in the slot a BUCKET's checksum takes), so the receivers wait as long as the trainer does.

Transports: `InProcessChannel` (receivers are objects in this process: tests, colocated engines) and
`BroadcastChannel` + `serve_broadcast` (a torch.distributed group: the sender broadcasts, acks come back
in one all_gather). Each wait on the group has a limit: a message and its acks must complete within
``timeout_s`` (``weight_sync.timeout_s``), a HELLO within ``join_timeout_s`` (the workers first finish the
requests queued before the push). A wait that overruns raises `ChannelTimeout`, which the sender and
`serve_broadcast` turn into `WeightSyncStalled`, naming the side and the bucket that is stuck (`watchdog`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Protocol

import torch
import torch.distributed as dist

from scalerl.comm.weights.delta import EncodedBucket, Positions, Values
from scalerl.comm.weights.watchdog import (
    WORKER,
    SyncProgress,
    group_ranks,
    job_board,
    own_rank,
    stall_message,
    stall_record,
)

HEADER_LEN = 12
ACK_LEN = 4


class Kind(IntEnum):
    HELLO = 1
    PLAN = 2
    BUCKET = 3
    END = 4
    ABORT = 5


class Status(IntEnum):
    OK = 1
    APPLY_FAILED = 2  # the store refused the write (an exception while applying)
    CHECKSUM_MISMATCH = 3  # the decoded or held bucket does not hash to the sender's snapshot
    PLAN_MISMATCH = 4  # no plan, another plan, or a plan the receiver's tensors do not fit
    DECODE_FAILED = 5  # the payload did not decode


class WeightSyncError(RuntimeError):
    """A sync that could not be completed (a receiver that keeps failing, a timeout, an abort)."""


class ChannelTimeout(WeightSyncError):
    """A wait on the group that overran its limit. ``phase``: ``send`` (the sender's broadcast), ``acks`` (the
    acknowledgements' gather) or ``receive`` (a receiver waiting for a message)."""

    def __init__(self, text: str, phase: str, limit_s: float):
        super().__init__(text)
        self.phase, self.limit_s = phase, limit_s


class WeightSyncStalled(WeightSyncError):
    """A step of a sync that did not complete within its limit, named by the watchdog: which side (the trainer
    sending, or which worker receiving), which bucket, the bytes moved so far and the ranks behind (``record``,
    the failure record the doctor's leaf ``rollout/weight_sync_stall`` reads)."""

    def __init__(self, record: dict):
        super().__init__(stall_message(record))
        self.record = record


@dataclass
class Message:
    kind: Kind
    bucket: int = -1
    version: int = 0
    plan_hash: int = 0
    checksum: int = 0
    encoded: EncodedBucket | None = None  # BUCKET only
    payload: bytes | memoryview = b""  # PLAN: the plan's JSON; BUCKET: the encoded bucket
    sync: int = 0  # the sender's sync number (the watchdog compares places by it)
    limit_ms: int = 0  # HELLO only: the sender's limit for each later step of the sync (0: none given)

    def header(self) -> torch.Tensor:
        e = self.encoded
        # A HELLO has no checksum: its slot carries the limit.
        fields = [int(self.kind), self.bucket, self.version, self.plan_hash,
                  self.limit_ms if self.kind == Kind.HELLO else self.checksum,
                  int(e.positions) if e else 0, int(e.values) if e else 0,
                  (int(e.positions_zlib) | int(e.values_zlib) << 1) if e else 0,
                  e.changed if e else 0, e.positions_nbytes if e else 0, len(self.payload), self.sync]
        return torch.tensor(fields, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire to each receiver: header + payload."""
        return HEADER_LEN * 8 + len(self.payload)

    @classmethod
    def from_wire(cls, header: torch.Tensor, payload: bytes | memoryview) -> Message:
        h = [int(x) for x in header.tolist()]
        kind = Kind(h[0])
        encoded = None
        if kind == Kind.BUCKET:
            encoded = EncodedBucket(Positions(h[5]), Values(h[6]), bool(h[7] & 1), bool(h[7] & 2), h[8], h[9],
                                    payload)
        hello = kind == Kind.HELLO
        return cls(kind, h[1], h[2], h[3], 0 if hello else h[4], encoded, payload, sync=h[11],
                   limit_ms=h[4] if hello else 0)


@dataclass
class Ack:
    status: Status
    checksum: int = 0
    version: int = 0
    plan_hash: int = 0

    def tensor(self) -> torch.Tensor:
        return torch.tensor([int(self.status), self.checksum, self.version, self.plan_hash], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Ack:
        s, c, v, p = (int(x) for x in t.tolist())
        return cls(Status(s) if s in Status._value2member_map_ else Status.APPLY_FAILED, c, v, p)


class SenderChannel(Protocol):
    """The sender's side of a transport: deliver one message to every receiver, return their acks."""

    num_receivers: int

    def exchange(self, message: Message) -> list[Ack]: ...

    def abort(self, message: Message) -> None:
        """Deliver ``ABORT`` (no acks: the receivers stop waiting and raise)."""
        ...


class InProcessChannel:
    """Receivers living in this process (anything with ``handle(Message) -> Ack``)."""

    def __init__(self, receivers: Sequence):
        self.receivers = list(receivers)

    @property
    def num_receivers(self) -> int:
        return len(self.receivers)

    def exchange(self, message: Message) -> list[Ack]:
        # Through the wire format, so in-process tests exercise exactly what a remote receiver parses.
        return [r.handle(Message.from_wire(message.header(), message.payload)) for r in self.receivers]

    def abort(self, message: Message) -> None:
        self.exchange(message)


def _wait(work, deadline: float, limit_s: float, what: str, phase: str) -> None:
    """Wait for ``work`` until ``deadline`` (time.monotonic()); a wait that overruns raises `ChannelTimeout`."""
    try:
        work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError as err:
        if is_timeout(err):
            raise ChannelTimeout(f"weight sync: {what} did not complete within {limit_s:g} s: {err}", phase,
                                 limit_s) from err
        raise WeightSyncError(f"weight sync: failed waiting for {what}: {err}") from err


def is_timeout(error: BaseException) -> bool:
    """A wait that ran out of time (gloo: "Timed out waiting ...", a work's own limit: "... timed out")."""
    return isinstance(error, ChannelTimeout) or "timed out" in str(error).lower()


class BroadcastChannel:
    """The sender's side over a process group: ``src`` (a global rank) broadcasts to the group's other
    ranks, which run `serve_broadcast`. ``device``: where the group's tensors live (cuda for NCCL).
    ``timeout_s``: the limit of each message and its acks (``weight_sync.timeout_s``); ``join_timeout_s``:
    a HELLO's (the workers first finish the requests queued before the push; default ``timeout_s``)."""

    def __init__(self, group, src: int, device: torch.device | str = "cpu", timeout_s: float = 600,
                 join_timeout_s: float | None = None):
        self.group, self.src, self.device = group, src, torch.device(device)
        self.timeout_s = timeout_s
        self.join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        self.num_receivers = dist.get_world_size(group) - 1

    @property
    def receiver_ranks(self) -> list[int]:
        """The receivers' global ranks (whose places the watchdog reads)."""
        return [r for r in group_ranks(self.group) if r != self.src]

    def limit(self, kind: Kind) -> tuple[float, str]:
        """A message's limit in seconds and the config key that sets it."""
        if kind == Kind.HELLO:
            return self.join_timeout_s, "trainer.dist_timeout_s"
        return self.timeout_s, "weight_sync.timeout_s"

    def exchange(self, message: Message) -> list[Ack]:
        limit_s, _ = self.limit(message.kind)
        deadline = time.monotonic() + limit_s
        _send(message, self.group, self.src, self.device, deadline, limit_s)
        acks = _gather_acks(Ack(Status.OK).tensor(), self.group, self.device, deadline, limit_s,
                            f"acks to message {message.kind.name} (bucket {message.bucket})")
        own = dist.get_group_rank(self.group, self.src) if self.group is not None else self.src
        return [Ack.from_tensor(a) for i, a in enumerate(acks) if i != own]

    def abort(self, message: Message) -> None:
        limit_s, _ = self.limit(message.kind)
        _send(message, self.group, self.src, self.device, time.monotonic() + limit_s, limit_s)


_RECEIVER_PLACE: dict[int, SyncProgress] = {}  # this process's place as a receiver, by its rank


def receiver_place() -> SyncProgress:
    """This process's place as a receiver (one per rank: it lasts across syncs)."""
    rank = own_rank()
    if rank not in _RECEIVER_PLACE:
        _RECEIVER_PLACE[rank] = SyncProgress(WORKER, rank)
    return _RECEIVER_PLACE[rank]


def serve_broadcast(handle: Callable[[Message], Ack], group, src: int, device: torch.device | str = "cpu",
                    timeout_s: float = 600) -> Message:
    """A receiver rank's side of one sync: answer messages from ``src`` until ``END`` (returned).
    Raises `WeightSyncError` on ``ABORT``, and `WeightSyncStalled` when a wait overruns: the HELLO's
    ``timeout_s``, later ones the sender's limit (from the HELLO, at most ``timeout_s``)."""
    device = torch.device(device)
    place, board = receiver_place(), job_board()
    limit_s, limit_key = timeout_s, "trainer.dist_timeout_s"
    receiver = getattr(handle, "__self__", None)  # a WeightReceiver's bound method: its plan names the tensors

    def moved(stage: str) -> None:
        place.stage = stage
        if board is not None:
            board.post(place)

    def stalled(err: ChannelTimeout, waiting_for: str, kind: str, bucket: int, index: int) -> WeightSyncStalled:
        moved(f"stalled: {waiting_for} did not come")
        peers = None
        if board is not None:
            board.post_now(place)
            peers = board.read(group_ranks(group))
        plan = getattr(receiver, "plan", None)
        tensors = ([seg.entry.name for seg in plan.segments(bucket)]
                   if plan is not None and 0 <= bucket < plan.num_buckets else [])
        return WeightSyncStalled(stall_record(place, waiting_for, err.phase, {"kind": kind, "bucket": bucket,
                                              "index": index, "tensors": tensors}, limit_s, limit_key, peers, src,
                                              str(err)))

    moved(f"waiting for sync {place.sync + 1} from the trainer (rank {src})")
    while True:
        waiting_for = (f"the next message from the trainer (rank {src}) after {place.last_done()}" if place.done
                       else f"the start of a sync from the trainer (rank {src})")
        deadline = time.monotonic() + limit_s
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        try:
            _wait(dist.broadcast(header, src=src, group=group, async_op=True), deadline, limit_s,
                  f"a weight-sync message header from rank {src}", "receive")
            size = int(header[10])
            payload = b""
            if size:
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                _wait(dist.broadcast(buf, src=src, group=group, async_op=True), deadline, limit_s,
                      f"a {size}-byte weight-sync payload from rank {src}", "receive")
                payload = memoryview(buf.cpu().numpy()).cast("B")
        except ChannelTimeout as err:
            raise stalled(err, waiting_for, "", -1, place.done) from err
        message = Message.from_wire(header.cpu(), payload)
        if message.kind == Kind.HELLO:
            place.begin(message.sync)
        if message.kind == Kind.ABORT:
            raise WeightSyncError(f"weight sync aborted by the sender (rank {src}), bucket {message.bucket}")
        what = f"bucket {message.bucket}" if message.kind == Kind.BUCKET else message.kind.name
        moved(f"applying {what}")
        ack = handle(message)
        index = place.done
        place.completed(message.kind.name, message.bucket, message.nbytes)
        if message.kind == Kind.PLAN and getattr(receiver, "plan", None) is not None:
            place.buckets = receiver.plan.num_buckets
        moved(f"waiting for the other ranks' acknowledgements of {what}")
        try:
            _gather_acks(ack.tensor(), group, device, time.monotonic() + limit_s, limit_s,
                         f"the other ranks' acks to {message.kind.name}")
        except ChannelTimeout as err:
            raise stalled(err, f"every rank's acknowledgement of {what}", message.kind.name, message.bucket,
                          index) from err
        if message.kind == Kind.HELLO and message.limit_ms > 0:  # every worker joined: the sender's limit from now on
            limit_s, limit_key = min(timeout_s, message.limit_ms / 1000), "weight_sync.timeout_s"
        if message.kind == Kind.END:
            moved(f"idle (sync {place.sync} done)")
            return message


def _send(message: Message, group, src: int, device: torch.device, deadline: float, limit_s: float) -> None:
    _wait(dist.broadcast(message.header().to(device), src=src, group=group, async_op=True), deadline, limit_s,
          f"the receivers to take a {message.kind.name} header", "send")
    if message.payload:
        payload = message.payload
        writable = isinstance(payload, memoryview) and not payload.readonly  # a bucket's own memory: no copy
        buf = torch.frombuffer(payload if writable else bytearray(payload), dtype=torch.uint8).to(device)
        _wait(dist.broadcast(buf, src=src, group=group, async_op=True), deadline, limit_s,
              f"the receivers to take a {len(message.payload)}-byte payload", "send")


def _gather_acks(ack: torch.Tensor, group, device: torch.device, deadline: float, limit_s: float,
                 what: str) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    out = [torch.zeros(ACK_LEN, dtype=torch.int64, device=device) for _ in range(size)]
    _wait(dist.all_gather(out, ack.to(device), group=group, async_op=True), deadline, limit_s, what, "acks")
    return [t.cpu() for t in out]
