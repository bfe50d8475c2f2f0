"""Weight sync from the trainer to rollout receivers: bucketed, lossless delta, verified, never drifting.

``WeightSender.sync(named_parameters)`` runs on every trainer rank (gathering a DTensor's full value is a
collective all of them join); the one rank holding the channel (the source) converts each bucket to the
rollout dtype and sends it:

- **bucketed**: tensors are walked in a fixed order and materialised one at a time (``full_tensor()``
  for FSDP2 / TP DTensors, the tensor itself for plain, DDP or pipeline-replica parameters), so the
  extra memory is about one bucket plus the tensor being cut (`SyncReport.peak_bucket_bytes`);
- **delta**: the source keeps a snapshot of exactly what the receivers hold (bit patterns in the rollout
  dtype) and sends each bucket's smallest lossless encoding against it (`delta_encoding`); the first
  sync, a receiver that restarted or lost its place, and ``mode="full"`` get a dense push;
- **verified**: each bucket carries the checksum of its new bits; every receiver answers with the
  checksum of what it holds after applying. A failure or mismatch gets that bucket resent dense at once
  (counted in ``resyncs``); the snapshot of a bucket moves on only once every receiver confirmed it, so
  a receiver that failed to apply a delta can never be left behind by a snapshot that moved on;
- **lossy, optional** (``static_every = K``): a tensor whose largest change since its last push is
  below ``static_threshold`` is deferred for up to K syncs (bounded staleness, reported);
- **auto** (``mode="auto"``): per sync, send the changed buckets as deltas or dense, whichever has cost less
  time per element so far (encoding, sending, the receivers' apply and verification, timed on the source):
  deltas win on slow links, dense buckets where encoding costs more than the bytes it saves (a worker on the
  trainer's host, fp32 weights that change everywhere). Every `AUTO_PROBE_EVERY`-th sync tries the other way.
  Both ways are lossless and verified alike.
- **watched**: each step of the push (a message, every worker's acknowledgement) has the channel's limit
  (``weight_sync.timeout_s``); one that overruns raises `WeightSyncStalled` naming the bucket, its tensors, the
  bytes sent so far and the workers behind (`watchdog`), instead of waiting on the collective's own timeout.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from scalerl.comm.weights.channel import (
    Kind,
    Message,
    SenderChannel,
    Status,
    WeightSyncError,
    WeightSyncStalled,
    is_timeout,
)
from scalerl.comm.weights.delta import (
    bucket_checksum,
    encode_bucket,
    encode_dense,
    int_view_dtype,
)
from scalerl.comm.weights.plan import TensorEntry, WeightPlan
from scalerl.comm.weights.watchdog import (
    TRAINER,
    ProgressBoard,
    SyncProgress,
    collective_limit_s,
    job_board,
    own_rank,
    stall_record,
)
from scalerl.core.device import PRECISION_DTYPES

MODES = ("full", "delta", "auto")
# mode "auto": every this many syncs, the way not currently preferred is tried again, so its cost stays current
AUTO_PROBE_EVERY = 8
MiB = 1 << 20
# Sync numbers, unique in this process whatever sender runs the sync, so the watchdog never mistakes a place in
# an earlier sync for one in this sync.
SYNC_NUMBERS = itertools.count(1)


@dataclass
class SyncReport:
    """What one sync did (on the source rank; other trainer ranks report zeros)."""

    bytes: int = 0  # sent to each receiver: headers, plan and payloads, resends included
    full_bytes: int = 0  # what one dense push of every tensor in the rollout dtype carries
    changed_elements: int = 0
    total_elements: int = 0
    static_tensors: int = 0  # no element changed (or deferred): not sent
    dynamic_tensors: int = 0
    resyncs: int = 0  # buckets resent dense after a receiver failed to apply or verify them
    full_push: bool = False
    peak_bucket_bytes: int = 0
    deferred_tensors: int = 0  # lossy mode: held back this sync
    max_deviation: float = 0.0  # lossy mode: largest |trainer - receiver| over deferred tensors
    max_staleness: int = 0  # lossy mode: most syncs any tensor has been held back
    dense_by_choice: bool = False  # mode auto: this sync sent its changed buckets dense (not a full push)
    buckets: int = 0
    encodings: dict[str, int] = field(default_factory=dict)  # bucket encoding name -> count
    seconds: float = 0.0  # the whole sync on the source
    slowest_step_s: float = 0.0  # the longest step after HELLO: preparing a message, sending it, every ack
    limit_s: float = 0.0  # the channel's limit of one such step (weight_sync.timeout_s); 0: none known
    prepare_seconds: float = 0.0  # of which gathering, converting, comparing and encoding (not the channel)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync/bytes": float(self.bytes),
            "weight_sync/full_bytes": float(self.full_bytes),
            "weight_sync/changed_fraction": self.changed_fraction,
            "weight_sync/static_tensors": float(self.static_tensors),
            "weight_sync/dynamic_tensors": float(self.dynamic_tensors),
            "weight_sync/resyncs": float(self.resyncs),
            "weight_sync/full_push": float(self.full_push),
            "weight_sync/peak_bucket_bytes": float(self.peak_bucket_bytes),
            "weight_sync/deferred_tensors": float(self.deferred_tensors),
            "weight_sync/max_deviation": self.max_deviation,
            "weight_sync/max_staleness": float(self.max_staleness),
            "weight_sync/dense_by_choice": float(self.dense_by_choice),
            "weight_sync/slowest_step_s": self.slowest_step_s,
            "weight_sync/timeout_s": self.limit_s,
        }


def _materialise(t: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter: a collective for DTensors (every rank of its mesh must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class WeightSender:
    def __init__(
        self,
        rollout_dtype: torch.dtype,
        bucket_bytes: int,
        channel: SenderChannel | None,
        mode: str = "delta",
        static_every: int = 0,
        static_threshold: float = 0.0,
        max_resends: int = 2,
    ):
        if mode not in MODES:
            raise ValueError(f"weight sync mode must be one of {MODES}, got {mode!r}")
        int_view_dtype(rollout_dtype)
        self.dtype, self.bucket_bytes, self.channel, self.mode = rollout_dtype, bucket_bytes, channel, mode
        self.static_every, self.static_threshold, self.max_resends = static_every, static_threshold, max_resends
        self.plan: WeightPlan | None = None
        self.snapshot: torch.Tensor | None = None  # source only: bits the receivers hold, in plan order
        self._snapshot_valid = False  # false until a first sync was confirmed (changes are then meaningful)
        self.staleness: dict[str, int] = {}
        # Versions carry a per-process random prefix, so a restarted sender never matches a stale receiver.
        self._session = int.from_bytes(os.urandom(3), "little") + 1
        self._counter = 0
        self.version = 0  # 0 = nothing confirmed yet
        self.cost_per_element: dict[str, float | None] = {"dense": None, "delta": None}  # mode auto, seconds
        self._auto_syncs = 0
        self._syncs = 0  # the number of the sync in progress or last run (every message carries it)
        self.progress: SyncProgress | None = None  # the source's place, for the watchdog
        self.board: ProgressBoard | None = None
        self._step_start = 0.0

    @classmethod
    def from_config(cls, weight_sync, rollout_dtype: str, channel: SenderChannel | None) -> WeightSender:
        """From the ``weight_sync`` config section and ``rollout.dtype``."""
        return cls(PRECISION_DTYPES[rollout_dtype], int(weight_sync.bucket_mb * MiB), channel, weight_sync.mode,
                   weight_sync.static_every, weight_sync.static_threshold)

    @property
    def is_source(self) -> bool:
        return self.channel is not None

    # ------------------------------------------------------------------------------------------- sync
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        start = time.perf_counter()
        tensors = [(n, t.detach()) for n, t in named_tensors]
        shapes = [(n, tuple(t.shape)) for n, t in tensors]
        if self.plan is None or shapes != [(e.name, e.shape) for e in self.plan.entries]:
            self.plan = WeightPlan.for_bucket_bytes(shapes, self.dtype, self.bucket_bytes)
            self.snapshot, self._snapshot_valid, self.version, self.staleness = None, False, 0, {}
        if not self.is_source:
            for _, t in tensors:  # join the source's gathers, in the same order (an empty tensor has no bucket)
                if isinstance(t, DTensor) and t.numel():
                    t.full_tensor()
            return SyncReport()
        report = self._sync_source(tensors)
        report.seconds = time.perf_counter() - start
        return report

    def _exchange(self, message: Message, report: SyncReport):
        message.sync = self._syncs
        limit = getattr(self.channel, "limit", None)
        if message.kind == Kind.HELLO and limit is not None:
            message.limit_ms = int(limit(Kind.BUCKET)[0] * 1000)  # the receivers wait as long
        report.bytes += message.nbytes
        what = f"bucket {message.bucket}" if message.kind == Kind.BUCKET else message.kind.name
        self._moved(f"sending {what} and waiting for every worker's acknowledgement")
        try:
            acks = self.channel.exchange(message)
        except RuntimeError as err:
            if isinstance(err, WeightSyncStalled) or not is_timeout(err):
                raise
            raise self._stalled(message, err) from err
        now = time.perf_counter()
        if message.kind != Kind.HELLO:
            report.slowest_step_s = max(report.slowest_step_s, now - self._step_start)
        self._step_start = now
        self.progress.completed(message.kind.name, message.bucket, message.nbytes)
        self._moved(f"{what} acknowledged")
        return acks

    # ------------------------------------------------------------------------------------- the watchdog
    def _moved(self, stage: str) -> None:
        self.progress.stage = stage
        if self.board is not None:
            self.board.post(self.progress)

    def _stalled(self, message: Message, err: RuntimeError) -> WeightSyncStalled:
        """The step of the sync that overran, named (`watchdog.stall_record`); the next sync is a full push."""
        self.version = 0  # the receivers hold an unverified mix
        limit = getattr(self.channel, "limit", None)
        limit_s, key = (limit(message.kind) if limit is not None  # else the process group's own (point to point)
                        else (collective_limit_s(getattr(self.channel, "device", "cpu")), "trainer.dist_timeout_s"))
        limit_s = getattr(err, "limit_s", limit_s)
        phase = getattr(err, "phase", "acks")  # a point-to-point channel's receive of the acks
        plan = self.plan
        if message.kind == Kind.BUCKET:
            what = f"bucket {message.bucket} of {plan.num_buckets}"
            tensors = [seg.entry.name for seg in plan.segments(message.bucket)]
        else:
            what, tensors = f"the {message.kind.name} message", []
        waiting_for = (f"every worker's acknowledgement of {what}" if phase == "acks"
                       else f"the workers taking {what}")
        if message.kind == Kind.HELLO:
            waiting_for = f"every worker joining sync {self._syncs} (its HELLO)"
        self._moved(f"stalled: {waiting_for} did not complete")
        peers = None
        ranks = _receiver_ranks(self.channel)
        if self.board is not None and ranks:
            self.board.post_now(self.progress)
            peers = self.board.read([own_rank(), *ranks])
        record = stall_record(self.progress, waiting_for, phase, {"kind": message.kind.name, "bucket": message.bucket,
                              "index": self.progress.done, "tensors": tensors}, limit_s, key, peers, own_rank(),
                              str(err))
        return WeightSyncStalled(record)

    def _sync_source(self, tensors: list[tuple[str, torch.Tensor]]) -> SyncReport:
        plan, h = self.plan, self.plan.hash64()
        report = SyncReport(full_bytes=plan.full_bytes, total_elements=plan.total_elems, buckets=plan.num_buckets)
        limit = getattr(self.channel, "limit", None)
        report.limit_s = limit(Kind.BUCKET)[0] if limit is not None else 0.0
        if self.progress is None:
            self.progress = SyncProgress(TRAINER, own_rank())
            self.board = job_board() if _receiver_ranks(self.channel) else None
        self._syncs = next(SYNC_NUMBERS)
        self.progress.begin(self._syncs, plan.num_buckets)
        self._step_start = time.perf_counter()
        acks = self._exchange(Message(Kind.HELLO, version=self.version, plan_hash=h), report)
        stale = [i for i, a in enumerate(acks) if self.version == 0 or a.version != self.version or a.plan_hash != h]
        full = self.mode == "full" or self.snapshot is None or bool(stale)
        report.full_push = full
        if full:
            acks = self._exchange(Message(Kind.PLAN, plan_hash=h, payload=plan.to_json().encode()), report)
            refused = [i for i, a in enumerate(acks) if a.status != Status.OK]
            if refused:
                self._abort(report, -1)
                raise WeightSyncError(f"weight sync: receivers {refused} refused the plan ({acks[refused[0]].status.name}"
                                      f"): their tensors do not match the trainer's names, shapes or {plan.dtype}")
            if self.snapshot is None:
                self.snapshot = torch.zeros(plan.total_elems, dtype=int_view_dtype(self.dtype))
            self.version = 0  # until END confirms the full push
        had_snapshot = self._snapshot_valid
        report.dense_by_choice = dense = not full and self._auto_picks_dense()
        way = "dense" if full or dense else "delta"
        spent, elements = 0.0, 0
        walker = _TensorWalker(tensors, plan, self, had_snapshot)
        dynamic: set[str] = set()
        for b in range(plan.num_buckets):
            lo, hi = plan.bucket_range(b)
            self._moved(f"preparing bucket {b} of {plan.num_buckets} (gathering, converting, encoding it)")
            prepare_start = time.perf_counter()
            new = walker.bucket(b)
            old = self.snapshot[lo:hi]
            changed = old.numpy() != new.numpy() if had_snapshot else np.ones(new.numel(), dtype=bool)
            report.changed_elements += int(np.count_nonzero(changed))
            for seg in plan.segments(b):
                if changed[seg.bucket_offset : seg.bucket_offset + seg.numel].any():
                    dynamic.add(seg.entry.name)
            bucket_changed = full or bool(changed.any())
            encoded = encode_dense(new) if full or (dense and bucket_changed) else encode_bucket(old, new, changed)
            report.encodings[encoded.name] = report.encodings.get(encoded.name, 0) + 1
            payload_copy = 0 if isinstance(encoded.payload, memoryview) else encoded.nbytes  # dense: a view of `new`
            report.peak_bucket_bytes = max(report.peak_bucket_bytes, walker.held_bytes + new.numel() * new.element_size()
                                           + changed.size + payload_copy)
            checksum = bucket_checksum(new)
            report.prepare_seconds += time.perf_counter() - prepare_start
            self._send_verified(b, new, checksum, encoded, h, report)
            old.copy_(new)  # every receiver confirmed this bucket: the snapshot moves on
            if bucket_changed:
                spent += time.perf_counter() - prepare_start
                elements += new.numel()
        if self.mode == "auto" and elements:
            cost, previous = spent / elements, self.cost_per_element[way]
            self.cost_per_element[way] = cost if previous is None else 0.5 * (previous + cost)
        self._counter += 1
        version = (self._session << 32) | self._counter
        acks = self._exchange(Message(Kind.END, version=version, plan_hash=h), report)
        if any(a.status != Status.OK or a.version != version for a in acks):
            self.version = 0
            raise WeightSyncError(f"weight sync: receivers did not confirm version {version}: {acks}")
        self.version, self._snapshot_valid = version, True
        self._moved(f"idle (sync {self._syncs} done)")
        report.dynamic_tensors = len(dynamic)
        report.static_tensors = len(plan.entries) - len(dynamic)
        report.deferred_tensors, report.max_deviation = walker.deferred, walker.max_deviation
        report.max_staleness = max(self.staleness.values(), default=0)
        return report

    def _auto_picks_dense(self) -> bool:
        """Mode auto: whether this sync sends its changed buckets dense. Each way is measured once first (the
        first sync is a full push: dense), then the cheaper per element wins, but every `AUTO_PROBE_EVERY`-th
        sync tries the other, as a delta's cost moves with how much of the model changes."""
        if self.mode != "auto":
            return False
        self._auto_syncs += 1
        dense, delta = self.cost_per_element["dense"], self.cost_per_element["delta"]
        if delta is None or dense is None:
            return delta is not None
        return (dense <= delta) != (self._auto_syncs % AUTO_PROBE_EVERY == 0)

    def _send_verified(self, b: int, new: torch.Tensor, checksum: int, encoded, plan_hash: int,
                       report: SyncReport) -> None:
        """Send bucket ``b`` until every receiver holds bits hashing to ``new``'s checksum: first as
        ``encoded``, then dense; after ``max_resends`` dense attempts, abort the sync."""
        message = Message(Kind.BUCKET, b, self.version, plan_hash, checksum, encoded, encoded.payload)
        for attempt in range(self.max_resends + 1):
            acks = self._exchange(message, report)
            failed = [(i, a) for i, a in enumerate(acks) if a.status != Status.OK or a.checksum != checksum]
            if not failed:
                return
            if attempt == self.max_resends:
                break
            report.resyncs += 1
            dense = encode_dense(new)
            message = Message(Kind.BUCKET, b, self.version, plan_hash, checksum, dense, dense.payload)
        self._abort(report, b)
        raise WeightSyncError(
            f"weight sync: bucket {b} still fails on receivers {[i for i, _ in failed]} after {self.max_resends} "
            f"dense resends ({', '.join(a.status.name for _, a in failed)}); sync aborted"
        )

    def _abort(self, report: SyncReport, bucket: int) -> None:
        self.version = 0  # receivers hold an unverified mix: the next sync is a full push
        message = Message(Kind.ABORT, bucket)
        report.bytes += message.nbytes
        self.channel.abort(message)


class _TensorWalker:
    """Walks the parameters in plan order, one full tensor at a time in the rollout dtype, and cuts
    buckets from them; applies the lossy mode's deferral per tensor."""

    def __init__(self, tensors: Sequence[tuple[str, torch.Tensor]], plan: WeightPlan, sender: WeightSender,
                 has_snapshot: bool):
        self.tensors, self.plan, self.sender, self.has_snapshot = tensors, plan, sender, has_snapshot
        self.view = int_view_dtype(plan.dtype)
        self.index = -1
        self.bits: torch.Tensor | None = None
        self.held_bytes = 0
        self.deferred, self.max_deviation = 0, 0.0

    def bucket(self, b: int) -> torch.Tensor:
        lo, hi = self.plan.bucket_range(b)
        out = torch.empty(hi - lo, dtype=self.view)
        for seg in self.plan.segments(b):
            bits = self._bits_of(seg.entry)
            out[seg.bucket_offset : seg.bucket_offset + seg.numel] = bits[seg.tensor_start : seg.tensor_stop]
        return out

    def _bits_of(self, entry: TensorEntry) -> torch.Tensor:
        index = self.plan.index_of(entry.name)
        if index == self.index:
            return self.bits
        self.bits = None  # drop the previous tensor before materialising the next
        param = self.tensors[index][1]
        full = _materialise(param)
        bits = full.to(dtype=self.plan.dtype).reshape(-1).to("cpu").view(self.view)
        # Bytes this tensor holds beyond the parameter itself: a gathered copy and/or a converted one.
        gathered = full.numel() * full.element_size() if isinstance(param, DTensor) else 0
        converted = 0 if bits.data_ptr() == full.data_ptr() else bits.numel() * bits.element_size()
        self.held_bytes = gathered + converted
        del full
        self.bits, self.index = self._maybe_defer(entry, bits), index
        return self.bits

    def _maybe_defer(self, entry: TensorEntry, bits: torch.Tensor) -> torch.Tensor:
        s = self.sender
        if not s.static_every or not self.has_snapshot:
            return bits
        held = s.snapshot[entry.start : entry.stop]
        if torch.equal(bits, held):  # up to date: nothing to defer
            s.staleness[entry.name] = 0
            return bits
        deviation = float((bits.view(self.plan.dtype).float() - held.view(self.plan.dtype).float()).abs().max())
        if deviation < s.static_threshold and s.staleness.get(entry.name, 0) < s.static_every:
            s.staleness[entry.name] = s.staleness.get(entry.name, 0) + 1
            self.deferred += 1
            self.max_deviation = max(self.max_deviation, deviation)
            return held.clone()
        s.staleness[entry.name] = 0
        return bits


def _receiver_ranks(channel) -> list[int]:
    """The global ranks a channel sends to (a broadcast group's, the point-to-point workers); [] in process."""
    ranks = getattr(channel, "receiver_ranks", None)
    if ranks is None:
        ranks = getattr(channel, "workers", None)
    return list(ranks or [])
