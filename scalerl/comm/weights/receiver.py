"""The receiving end of a weight sync: apply each bucket to the weights it holds and prove it did.

The receiver reads the bucket's current bits from its `WeightStore`, decodes the sender's change
against them, writes the pieces that changed back, tells the store which tensors are complete and
changed (an engine that keeps its own copy loads them then), and answers with the checksum of what the
store holds after the write, so the sender compares against what is really there (a delta applied to
weights that drifted does not match). Any failure is answered, not raised: the sender resends that
bucket dense, and its snapshot does not move on until every receiver confirms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from scalerl.comm.weights.channel import Ack, Kind, Message, Status
from scalerl.comm.weights.delta import (
    DecodeError,
    bucket_checksum,
    combine_checksums,
    decode_bucket,
    int_view_dtype,
)
from scalerl.comm.weights.plan import BucketSegment, WeightPlan


class WeightStore(Protocol):
    """Where a receiver's weights live, in the rollout dtype, written in place."""

    def prepare(self, plan: WeightPlan) -> None:
        """Make a contiguous tensor of the plan's dtype and shape ready for every entry (or raise
        ValueError naming the tensor that cannot be held)."""
        ...

    def tensor(self, name: str) -> torch.Tensor:
        """The held tensor ``name`` (read for the delta base, written in place)."""
        ...

    def loaded(self, names: Sequence[str]) -> None:
        """The named tensors are complete and changed since the last call: make them live."""
        ...


class TensorDictStore:
    """A store over a plain ``{name: tensor}`` dict, allocating zeros for names it lacks."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, device: torch.device | str = "cpu"):
        self.tensors = tensors if tensors is not None else {}
        self.device = torch.device(device)

    def prepare(self, plan: WeightPlan) -> None:
        for e in plan.entries:
            t = self.tensors.get(e.name)
            if t is None or t.dtype != plan.dtype or tuple(t.shape) != e.shape:
                self.tensors[e.name] = torch.zeros(e.shape, dtype=plan.dtype, device=self.device)

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def loaded(self, names: Sequence[str]) -> None:
        pass


def check_store_fits(store: WeightStore, plan: WeightPlan) -> None:
    """Every planned tensor is held contiguous, in the plan's dtype and shape (ValueError naming it)."""
    for e in plan.entries:
        t = store.tensor(e.name)
        if t.dtype != plan.dtype or tuple(t.shape) != e.shape or not t.is_contiguous():
            raise ValueError(f"weight sync: receiver holds {e.name} as {t.dtype} {tuple(t.shape)} "
                             f"(contiguous={t.is_contiguous()}), the sender sends {plan.dtype} {e.shape}")


class WeightReceiver:
    def __init__(self, store: WeightStore):
        self.store = store
        self.plan: WeightPlan | None = None
        self.plan_hash = 0
        self.version = 0  # the sender's version this receiver holds, verified; 0 = none
        self.last_error = ""
        self._failed: set[int] = set()  # buckets of this sync not verified yet
        self._dirty: set[str] = set()  # tensors changed whose last segment has not been applied yet
        self.bytes_received = 0

    def handle(self, message: Message) -> Ack:
        self.bytes_received += message.nbytes
        if message.kind == Kind.HELLO:
            self._failed.clear()
            self._dirty.clear()
            return Ack(Status.OK, 0, self.version, self.plan_hash)
        if message.kind == Kind.PLAN:
            return self._set_plan(message)
        if message.kind == Kind.BUCKET:
            ack = self._apply_bucket(message)
            (self._failed.discard if ack.status == Status.OK else self._failed.add)(message.bucket)
            return ack
        if message.kind == Kind.END:
            ok = not self._failed and self.plan is not None
            self.version = message.version if ok else 0
            return Ack(Status.OK if ok else Status.CHECKSUM_MISMATCH, 0, self.version, self.plan_hash)
        self.version = 0  # ABORT: what is held is partly updated and unverified
        return Ack(Status.OK, 0, 0, self.plan_hash)

    def _fail(self, status: Status, error: str) -> Ack:
        self.last_error = error
        return Ack(status, 0, self.version, self.plan_hash)

    def _set_plan(self, message: Message) -> Ack:
        self.version, self.plan, self.plan_hash = 0, None, 0
        try:
            plan = WeightPlan.from_json(bytes(message.payload).decode("utf-8"))
            int_view_dtype(plan.dtype)
            self.store.prepare(plan)
            check_store_fits(self.store, plan)
        except (ValueError, KeyError, UnicodeDecodeError) as err:
            return self._fail(Status.PLAN_MISMATCH, f"plan refused: {err}")
        if plan.hash64() != message.plan_hash:
            return self._fail(Status.PLAN_MISMATCH, "plan JSON does not match the hash the sender sent")
        self.plan, self.plan_hash = plan, message.plan_hash
        self._dirty = {e.name for e in plan.entries}  # a full push makes every tensor live again
        return Ack(Status.OK, 0, 0, self.plan_hash)

    def _views(self, segments: list[BucketSegment]) -> list[torch.Tensor]:
        view = int_view_dtype(self.plan.dtype)
        return [self.store.tensor(s.entry.name).view(-1).view(view)[s.tensor_start : s.tensor_stop] for s in segments]

    def _apply_bucket(self, message: Message) -> Ack:
        plan = self.plan
        if plan is None or message.plan_hash != self.plan_hash:
            return self._fail(Status.PLAN_MISMATCH, "bucket for a plan this receiver does not hold")
        if not 0 <= message.bucket < plan.num_buckets:
            return self._fail(Status.DECODE_FAILED, f"bucket {message.bucket} outside the plan")
        segments = plan.segments(message.bucket)
        views = self._views(segments)
        # One bucket-sized copy of what is held (the delta's base), decoded in place.
        new = torch.cat([v.cpu() for v in views]) if views else torch.zeros(0, dtype=int_view_dtype(plan.dtype))
        try:
            decode_bucket(new, message.encoded, in_place=True)
        except (DecodeError, ValueError) as err:
            return self._fail(Status.DECODE_FAILED, f"bucket {message.bucket}: {err}")
        try:
            complete = []
            for seg, view in zip(segments, views):
                piece = new[seg.bucket_offset : seg.bucket_offset + seg.numel].to(view.device)
                if not torch.equal(piece, view):
                    view.copy_(piece)
                    self._dirty.add(seg.entry.name)
                if seg.completes_tensor and seg.entry.name in self._dirty:
                    complete.append(seg.entry.name)
                    self._dirty.discard(seg.entry.name)
            if complete:
                self.store.loaded(complete)
        except Exception as err:  # noqa: BLE001 - any failure to apply is answered; the sender resends dense
            self._dirty.update(s.entry.name for s in segments)
            return self._fail(Status.APPLY_FAILED, f"bucket {message.bucket}: {type(err).__name__}: {err}")
        del new
        # What the store holds now, piece by piece (no second bucket-sized copy).
        checksum = combine_checksums([bucket_checksum(v, s.bucket_offset) for s, v in zip(segments, self._views(segments))])
        if checksum != message.checksum:
            self._dirty.update(s.entry.name for s in segments)  # reloaded when the dense resend lands
            return self._fail(Status.CHECKSUM_MISMATCH, f"bucket {message.bucket}: held bits do not hash to the "
                                                        "sender's snapshot (a delta applied to weights that drifted?)")
        return Ack(Status.OK, checksum, self.version, self.plan_hash)
