"""How weight-sync messages travel: one sender, any number of receivers, one acknowledgement per message.

A sync is a conversation the sender leads: ``HELLO`` (receivers answer with the version and plan they
hold), ``PLAN`` (full pushes only), one ``BUCKET`` per bucket (and again, dense, for a bucket a receiver
could not verify), ``END`` (the new version), or ``ABORT``. Every message is a fixed int64 header and an
optional byte payload; every receiver answers each message with a 4-int64 ack (status, checksum of what
it now holds, version, plan hash), so the sender learns about a failure at the bucket that failed and
can resend it from the bucket it still holds.

Transports: `InProcessChannel` (receivers are objects in this process: tests, colocated engines) and
`BroadcastChannel` + `serve_broadcast` (a torch.distributed group: the sender broadcasts, acks come back
in one all_gather). Each wait on the group has a timeout and says what it waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Protocol

import torch
import torch.distributed as dist

from scalerl.comm.weights.delta import EncodedBucket, Positions, Values

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


@dataclass
class Message:
    kind: Kind
    bucket: int = -1
    version: int = 0
    plan_hash: int = 0
    checksum: int = 0
    encoded: EncodedBucket | None = None  # BUCKET only
    payload: bytes | memoryview = b""  # PLAN: the plan's JSON; BUCKET: the encoded bucket

    def header(self) -> torch.Tensor:
        e = self.encoded
        fields = [int(self.kind), self.bucket, self.version, self.plan_hash, self.checksum,
                  int(e.positions) if e else 0, int(e.values) if e else 0,
                  (int(e.positions_zlib) | int(e.values_zlib) << 1) if e else 0,
                  e.changed if e else 0, e.positions_nbytes if e else 0, len(self.payload), 0]
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
        return cls(kind, h[1], h[2], h[3], h[4], encoded, payload)


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


def _wait(work, timeout: timedelta, what: str) -> None:
    try:
        work.wait(timeout=timeout)
    except RuntimeError as err:
        raise WeightSyncError(f"weight sync: timed out or failed after {timeout.total_seconds():.0f} s waiting "
                              f"for {what}: {err}") from err


class BroadcastChannel:
    """The sender's side over a process group: ``src`` (a global rank) broadcasts to the group's other
    ranks, which run `serve_broadcast`. ``device``: where the group's tensors live (cuda for NCCL)."""

    def __init__(self, group, src: int, device: torch.device | str = "cpu", timeout_s: float = 600):
        self.group, self.src, self.device = group, src, torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self.num_receivers = dist.get_world_size(group) - 1

    def exchange(self, message: Message) -> list[Ack]:
        _send(message, self.group, self.src, self.device, self.timeout)
        acks = _gather_acks(Ack(Status.OK).tensor(), self.group, self.device, self.timeout,
                            f"acks to message {message.kind.name} (bucket {message.bucket})")
        own = dist.get_group_rank(self.group, self.src) if self.group is not None else self.src
        return [Ack.from_tensor(a) for i, a in enumerate(acks) if i != own]

    def abort(self, message: Message) -> None:
        _send(message, self.group, self.src, self.device, self.timeout)


def serve_broadcast(handle: Callable[[Message], Ack], group, src: int, device: torch.device | str = "cpu",
                    timeout_s: float = 600) -> Message:
    """A receiver rank's side of one sync: answer messages from ``src`` until ``END`` (returned).
    Raises `WeightSyncError` on ``ABORT`` or when a message does not come within ``timeout_s``."""
    device, timeout = torch.device(device), timedelta(seconds=timeout_s)
    while True:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        _wait(dist.broadcast(header, src=src, group=group, async_op=True), timeout,
              f"a weight-sync message header from rank {src}")
        size = int(header[10])
        payload = b""
        if size:
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            _wait(dist.broadcast(buf, src=src, group=group, async_op=True), timeout,
                  f"a {size}-byte weight-sync payload from rank {src}")
            payload = memoryview(buf.cpu().numpy()).cast("B")
        message = Message.from_wire(header.cpu(), payload)
        if message.kind == Kind.ABORT:
            raise WeightSyncError(f"weight sync aborted by the sender (rank {src}), bucket {message.bucket}")
        ack = handle(message)
        _gather_acks(ack.tensor(), group, device, timeout, f"the other ranks' acks to {message.kind.name}")
        if message.kind == Kind.END:
            return message


def _send(message: Message, group, src: int, device: torch.device, timeout: timedelta) -> None:
    _wait(dist.broadcast(message.header().to(device), src=src, group=group, async_op=True), timeout,
          f"the receivers to take a {message.kind.name} header")
    if message.payload:
        payload = message.payload
        writable = isinstance(payload, memoryview) and not payload.readonly  # a bucket's own memory: no copy
        buf = torch.frombuffer(payload if writable else bytearray(payload), dtype=torch.uint8).to(device)
        _wait(dist.broadcast(buf, src=src, group=group, async_op=True), timeout,
              f"the receivers to take a {len(message.payload)}-byte payload")


def _gather_acks(ack: torch.Tensor, group, device: torch.device, timeout: timedelta, what: str) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    out = [torch.zeros(ACK_LEN, dtype=torch.int64, device=device) for _ in range(size)]
    _wait(dist.all_gather(out, ack.to(device), group=group, async_op=True), timeout, what)
    return [t.cpu() for t in out]
