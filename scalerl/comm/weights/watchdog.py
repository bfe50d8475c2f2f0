"""The weight-sync watchdog: every step of a sync has a limit, and a sync that overruns it names who is stuck.

A sync is a lock-step conversation (`channel`): the trainer sends a message, every worker answers it, the
acknowledgements are gathered, then the next. A side whose wait overruns its limit knows only that it
waited. So each side keeps its place (`SyncProgress`: the sync's number, the messages it has sent or
answered, the last bucket done, the bytes so far, what it is doing now), updated per message as plain
attributes, and a daemon thread posts it to the job's TCP store (`scalerl/weight_sync/<rank>`) at most
every `POST_INTERVAL_S` while it changes (`ProgressBoard`): nothing on the sync's own path waits on the
store. When a wait overruns, the side that waited reads every other side's place and `stall_record` names the
ones behind it: the worker that never answered bucket k (it stopped receiving, or is stuck applying it), the
workers that never joined the sync (still generating, or gone), or the trainer that stopped sending after
bucket k (stuck preparing the next one). The record is the failure record the doctor's leaf
``rollout/weight_sync_stall`` reads (`scalerl.health.rollout_rules`); `stall_message` says it in one paragraph.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

POST_INTERVAL_S = 0.25  # the store holds each side's place at most this stale
READ_LIMIT_S = 5.0  # reading the others' places after a stall: rank 0 (the store's host) may be frozen itself
KEY = "scalerl/weight_sync/{rank}"
TRAINER, WORKER = "trainer", "worker"
TENSORS_NAMED = 4  # a bucket's tensors named in a message (the record keeps them all)


@dataclass
class SyncProgress:
    """Where one side of the conversation is. ``done``: messages of sync ``sync`` this side has completed (the
    trainer: sent and acknowledged by every worker; a worker: answered); ``stage``: what it is doing now."""

    role: str
    rank: int
    sync: int = 0
    done: int = 0
    kind: str = ""  # the last message completed: HELLO, PLAN, BUCKET, END
    bucket: int = -1  # the last bucket completed in this sync (-1: none yet)
    buckets: int = 0
    bytes: int = 0  # sent (trainer) or received (worker) in this sync so far
    stage: str = "no sync yet"
    at: float = field(default_factory=time.time)  # when it last moved (seconds since the epoch)

    def begin(self, sync: int, buckets: int = 0) -> None:
        self.sync, self.done, self.kind, self.bucket, self.bytes = sync, 0, "", -1, 0
        self.buckets = buckets
        self.at = time.time()

    def completed(self, kind: str, bucket: int, nbytes: int) -> None:
        self.done += 1
        self.kind, self.bytes, self.at = kind, self.bytes + nbytes, time.time()
        if kind == "BUCKET":
            self.bucket = bucket

    def last_done(self) -> str:
        """The last thing it completed in its sync, in words."""
        if self.kind == "BUCKET":
            return f"bucket {self.bucket}" + (f" of {self.buckets}" if self.buckets else "")
        return f"its {self.kind}" if self.kind else "nothing"


class ProgressBoard:
    """Posts this process's `SyncProgress` to the job's store from a daemon thread; reads the others' places."""

    def __init__(self, store: Any):
        self.store = store
        self._progress: SyncProgress | None = None
        self._changes = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls) -> ProgressBoard | None:
        """A board on the job's TCP store at MASTER_ADDR:MASTER_PORT, on a connection of its own (the trainer's
        collectives keep theirs); None without a job (one process) or when the store does not answer."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not dist.is_initialized() or not addr or not port:
            return None
        try:
            store = dist.TCPStore(addr, int(port), dist.get_world_size(), is_master=False,
                                  timeout=timedelta(seconds=READ_LIMIT_S))
        except Exception:  # no store to post to: the watchdog still names this side's own place
            return None
        return cls(store)

    def post(self, progress: SyncProgress) -> None:
        """``progress`` changed (a cheap call: the thread writes it, at most every `POST_INTERVAL_S`)."""
        with self._lock:
            self._progress, self._changes = progress, self._changes + 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scalerl-weight-sync-progress", daemon=True)
            self._thread.start()
        self._wake.set()

    def post_now(self, progress: SyncProgress) -> None:
        """Write ``progress`` at once (a side that stalled says so before it reads the others)."""
        try:
            self.store.set(KEY.format(rank=progress.rank), json.dumps(asdict(progress)))
        except Exception:  # the store is gone: the job is ending
            pass

    def _run(self) -> None:
        posted = 0
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                progress, changes = self._progress, self._changes
            if changes != posted and progress is not None:
                try:
                    self.store.set(KEY.format(rank=progress.rank), json.dumps(asdict(progress)))
                except Exception:  # the store (rank 0) is gone: the job is ending
                    return
                posted = changes
            time.sleep(POST_INTERVAL_S)

    def read(self, ranks: list[int]) -> dict[int, dict[str, Any]] | None:
        """The places the ``ranks`` last posted ({} for a rank that never posted); None when the store does
        not answer within `READ_LIMIT_S` (rank 0, its host, frozen: a frozen process's socket still accepts
        connections and never replies, so the read runs in a thread that is abandoned)."""
        time.sleep(2 * POST_INTERVAL_S)  # the others' last moves reach the store
        found: dict[int, dict[str, Any]] = {}
        finished = threading.Event()

        def read_all() -> None:
            for rank in ranks:
                key = KEY.format(rank=rank)
                found[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else {}
            finished.set()

        reader = threading.Thread(target=_quietly, args=(read_all,), name="scalerl-weight-sync-read", daemon=True)
        reader.start()
        reader.join(READ_LIMIT_S)
        return found if finished.is_set() else None


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # an unreadable store shows as no answer
        pass


_BOARD: dict[str, ProgressBoard | None] = {}


def job_board() -> ProgressBoard | None:
    """This process's board (made once)."""
    if "board" not in _BOARD:
        _BOARD["board"] = ProgressBoard.for_job()
    return _BOARD["board"]


def own_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the whole world)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def collective_limit_s(device: torch.device | str = "cpu", default: float = 600.0) -> float:
    """The default group's collective limit (what ``trainer.dist_timeout_s`` set), ``default`` when it cannot be
    read (no group, or a torch that keeps it elsewhere)."""
    try:
        return dist.group.WORLD._get_backend(torch.device(device)).options._timeout.total_seconds()
    except Exception:  # a private attribute: then the trainer's default limit
        return default


# ------------------------------------------------------------------------------------------ the diagnosis
def _position(place: dict[str, Any]) -> tuple[int, int]:
    return int(place.get("sync", -1)), int(place.get("done", -1))


def _describe(rank: int, place: dict[str, Any], now: float) -> dict[str, Any]:
    if not place:
        return {"rank": rank, "role": WORKER, "state": "posted no progress (it never reached a weight sync)"}
    quiet = now - float(place.get("at", now))
    bucket = int(place.get("bucket", -1))
    last = (f"bucket {bucket}" if bucket >= 0 else place.get("kind") or "nothing") + f" of sync {place.get('sync')}"
    return {"rank": rank, "role": place.get("role", WORKER), "sync": place.get("sync"), "done": place.get("done"),
            "last_bucket": bucket, "bytes": place.get("bytes", 0), "quiet_s": round(quiet, 3),
            "state": f"last completed {last}; now {place.get('stage', '?')} (for {quiet:.1f} s)"}


def stall_record(own: SyncProgress, waiting_for: str, phase: str, message: dict[str, Any], limit_s: float,
                 limit_key: str, peers: dict[int, dict[str, Any]] | None, trainer_rank: int,
                 error: str) -> dict[str, Any]:
    """The failure record of a wait that overran: this side's place and what it waited for, and the ranks
    behind it (``stuck``) with where each is.

    ``phase``: ``acks`` (the acknowledgements of message ``message['index']``: the workers that have not answered
    it are stuck), ``send`` (the trainer's broadcast of that message: the workers not yet done with the one before
    it, or not in the sync at all, are stuck) or ``receive`` (a worker waiting for that message: the trainer is
    the side that has to act, plus any worker behind). ``message``: kind, bucket, index in the sync, tensors."""
    now = time.time()
    index = int(message.get("index", own.done))
    needed = {"acks": index + 1, "send": index, "receive": index}[phase]
    stuck: list[dict[str, Any]] = []
    if peers is not None:
        for rank, place in sorted(peers.items()):
            if rank == own.rank:
                continue
            is_trainer = rank == trainer_rank
            if is_trainer:
                if phase == "receive":
                    stuck.append(_describe(rank, place, now))
                continue
            # A broadcast cannot be taken by a worker that left the sync after a stall of its own.
            gave_up = (phase == "send" and int(place.get("sync", -1)) == own.sync
                       and str(place.get("stage", "")).startswith("stalled"))
            if _position(place) < (own.sync, needed) or gave_up:
                stuck.append(_describe(rank, place, now))
    return {
        "side": own.role, "rank": own.rank, "sync": own.sync, "phase": phase, "waiting_for": waiting_for,
        "kind": message.get("kind", ""), "bucket": int(message.get("bucket", -1)), "buckets": own.buckets,
        "tensors": list(message.get("tensors", [])), "bytes": own.bytes, "done": own.done,
        "last_bucket": own.bucket, "limit_s": limit_s, "limit_key": limit_key, "stuck": stuck,
        "peers_read": peers is not None, "trainer_rank": trainer_rank, "error": error.strip().splitlines()[0][:300]
        if error.strip() else "",
    }


def stall_message(record: dict[str, Any]) -> str:
    """The record in one paragraph: who waited for what, how long, and who is behind."""
    side = (f"trainer rank {record['rank']} sending" if record["side"] == TRAINER
            else f"worker rank {record['rank']} receiving")
    tensors = record["tensors"]
    named = (f" (tensors {', '.join(tensors[:TENSORS_NAMED])}" + (f" and {len(tensors) - TENSORS_NAMED} more"
             if len(tensors) > TENSORS_NAMED else "") + ")") if tensors else ""
    moved = "sent" if record["side"] == TRAINER else "received"
    text = (f"weight sync stalled ({side}, sync {record['sync']}): {record['waiting_for']}{named} did not complete "
            f"within {record['limit_key']}={record['limit_s']:g} s; {record['bytes']:,} B {moved} in this sync so far, "
            + (f"the last bucket done {record['last_bucket']}" + (f" of {record['buckets']}" if record["buckets"] else "")
               if record["last_bucket"] >= 0 else "no bucket done yet"))
    if not record["peers_read"]:
        text += ("; the other sides' progress could not be read (the job's store at rank 0 did not answer: rank 0 "
                 "is frozen or gone)")
    elif record["stuck"]:
        text += "; behind: " + "; ".join(
            f"{'trainer' if s['rank'] == record['trainer_rank'] else 'worker'} rank {s['rank']}: {s['state']}"
            for s in record["stuck"])
    else:
        text += "; every other side had done its part (a slow link, or a rank that left the sync)"
    return text
