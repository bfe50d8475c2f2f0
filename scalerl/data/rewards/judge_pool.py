"""The generative judge in a pool of its own worker processes (``data.judge.workers=N``), so that judging
overlaps generation (NeMo-RL serves its GenRM as a separate vLLM pool in the same spirit).

Each worker is a clean process (forked from multiprocessing's fork server, `START_METHOD`) that builds the
judge once from a copy of the ``data.judge`` section (`scalerl.data.rewards.judge.judge_from_section`: the
built-in engine on the given device, or vLLM) and then runs judge calls. The trainer hands a part's rows to
the pool as soon as the part has generated (`PooledJudge.prefetch`, called by `RewardComputer.start`) and
takes the verdicts when the part's rewards are needed (`PooledJudge.__call__`, called by
`RewardComputer.compute` as any batched reward is): the workers judge while the trainer generates the next
part. Each trainer rank has its own pool.

A call is cut into tasks the way the in-process judge batches it, so a verdict never depends on the number
of workers: a number or label judge's rows in runs of ``data.judge.batch_size`` from the call's first row
(the in-process judge's generation batches, each one task), a pairwise judge's whole call (its comparisons
are batched over every group of the call) as one task. Sampling is greedy, so ``workers=0`` (in process) and
``workers=N`` give the same verdicts (tests/data/rewards/test_judge_pool.py checks it on a real model).

One thread of the trainer's process owns the workers' pipes: it sends queued tasks to idle workers and
takes their replies while the trainer's own thread generates, so no pipe ever fills while both sides
write. An answer without a verdict comes back as the in-process judge returns it (the raw text in a
failure message: counted, logged, never a silent 0). A task whose worker dies is run again on another
(`RETRIES` times: the worker may have died before it began), then fails its call with `RewardCrash`; one
running past ``timeout_s`` (``data.reward_timeout_s``) plus `KILL_GRACE_S` has its worker killed and fails
the same way; a dead or killed worker is replaced. Waiting for a call's verdicts is bounded too (`result`),
and the reward computer's own limit (``data.reward_timeout_s`` per call) applies as to any reward.
``calls`` keeps the latest tasks' start and end (``time.monotonic``, one clock for every process of the
machine): what the tests and benchmarks/judge_overlap.py read to see the judging overlap the generation.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from types import SimpleNamespace
from typing import Any

from scalerl.data.rewards.calls import RewardCrash, RewardTimeout
from scalerl.data.rewards.functions import RewardFunctionError

# Forked from multiprocessing's fork server: a clean process (no copy of the trainer's threads, locks or CUDA
# state), as with "spawn", without importing torch and the model code afresh in each worker (seconds each on
# a small machine); the server imports `PRELOAD` once, where this process starts it (a server already
# running, e.g. one `scalerl verify` started, is used as it is: its workers import the rest themselves).
START_METHOD = "forkserver"
PRELOAD = ["torch", "scalerl.data.rewards.judge", "scalerl.models.load", "scalerl.rollout.engines.builtin"]
KILL_GRACE_S = 5.0  # past its limit, a task's worker is killed (a judge stuck in generation)
STARTUP_LIMIT_S = 300.0  # a worker not ready this long after it started: loading the judge hangs
RETRIES = 1  # a task whose worker died is run again this many times (a judge that crashes on it, fails)
STARTUP_DEATHS = 3  # workers in a row dying before they are ready: the pool cannot start
RESULT_SLACK_S = 10.0  # `result`'s own limit is a backstop: the pool's kills of hung tasks come well before it
CALLS_KEPT = 4096  # task timings kept in `JudgePool.calls`
_MAX_UNCLAIMED = 64  # prefetched calls never claimed (a step that failed) are dropped beyond this many


class JudgePoolError(RewardFunctionError):
    """The judge workers cannot load the judge, or keep dying before they are ready."""


@dataclass
class JudgeCall:
    """One judge call on its way: its tasks' results, filled in by the pool's thread."""

    size: int
    tasks: int
    verdicts: list[Any] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    error: BaseException | None = None
    done: dict[int, tuple[list[Any], list[str]]] = field(default_factory=dict)  # task start row -> its result


def call_tasks(kind: str, batch_size: int, size: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` row ranges a call of ``size`` rows is judged in: the in-process judge's own
    generation batches (runs of ``batch_size``); pairwise, the whole call (its comparisons span groups)."""
    if kind == "pairwise" or size == 0:
        return [(0, size)]
    return [(start, min(start + batch_size, size)) for start in range(0, size, batch_size)]


@dataclass
class _Worker:
    process: Any
    conn: Connection
    started_at: float
    ready: bool = False
    task: tuple | None = None  # the queue entry it runs: (call id, start, stop, arguments, tries so far)
    sent_at: float = 0.0


class JudgePool:
    """``workers`` processes, each with the judge of ``section`` (a ``data.judge`` section) on ``device``."""

    def __init__(self, section: Any, device: str, workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"a judge pool needs at least 1 worker, got {workers}")
        self.fields = {name: getattr(section, name) for name in _SECTION_FIELDS if hasattr(section, name)}
        self.kind, self.batch_size = section.verdict, section.batch_size
        self.device, self.size, self.timeout_s = str(device), workers, timeout_s
        # CPU judges share the machine's cores with the trainer: each gets its share, not all of them.
        self.threads = max(1, (os.cpu_count() or 1) // (workers + 1))
        # (worker pid, began, ended) of the latest tasks, in the order they ended
        self.calls: deque[tuple[int, float, float]] = deque(maxlen=CALLS_KEPT)
        self.replaced = 0
        self._context = multiprocessing.get_context(START_METHOD)
        _add_forkserver_preload(self._context)
        self._workers: list[_Worker] = []
        self._queue: deque[tuple] = deque()  # (call id, start, stop, arguments, tries so far)
        self._pending: dict[int, JudgeCall] = {}
        self._next_id = 0
        self._lock = threading.Condition()
        self._startup_deaths = 0
        self._failure: BaseException | None = None  # the pool cannot run (raised to the next caller)
        self._closed = False
        self._wake_read, self._wake_write = self._context.Pipe(duplex=False)
        for _ in range(workers):
            self._start_worker()
        self._thread = threading.Thread(target=self._serve, name="scalerl-judge-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ the trainer's side
    def submit(self, prompts: Sequence[Any], completions: Sequence[Any], truths: Sequence[Any]) -> int:
        """Queue a judge call (returns at once); its id for `result`."""
        tasks = call_tasks(self.kind, self.batch_size, len(prompts))
        with self._lock:
            self._raise_failure()
            call_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[call_id] = JudgeCall(len(prompts), len(tasks))
            for start, stop in tasks:
                arguments = (list(prompts[start:stop]), list(completions[start:stop]), list(truths[start:stop]))
                self._queue.append((call_id, start, stop, arguments, 0))
            if len(self._pending) > _MAX_UNCLAIMED:  # never claimed: a step that stopped before its rewards
                self.discard(min(self._pending))
        self._wake()
        return call_id

    def result(self, call_id: int, timeout_s: float | None = None) -> tuple[list[Any], list[str]]:
        """The call's verdicts (a score, or the failure text of an answer without a verdict) and the judge's raw
        answers, waiting for them at most ``timeout_s`` (default: the pool's limit per task plus the kill grace,
        times its tasks over the workers, plus `RESULT_SLACK_S`); a worker that died or hung in it raises
        `RewardCrash`."""
        with self._lock:
            call = self._pending.get(call_id)
            if call is None:
                raise KeyError(f"no judge call {call_id} in flight")
            limit = timeout_s if timeout_s is not None else RESULT_SLACK_S + STARTUP_LIMIT_S * (not self._any_ready()) \
                + (self.timeout_s + KILL_GRACE_S) * -(-call.tasks // self.size)
            deadline = time.monotonic() + limit
            while len(call.done) < call.tasks and call.error is None and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._pending.pop(call_id, None)
                    raise RewardTimeout(f"the judge pool gave no verdicts within {limit:g} s")
                self._lock.wait(left)
            self._pending.pop(call_id, None)
            self._raise_failure()
            if call.error is not None:
                raise call.error
            verdicts: list[Any] = []
            texts: list[str] = []
            for start in sorted(call.done):
                verdicts += call.done[start][0]
                texts += call.done[start][1]
            return verdicts, texts

    def wait_ready(self) -> None:
        """Until every worker has loaded the judge (a model that cannot load fails here, at the run's start,
        not as the first step's rewards), at most `STARTUP_LIMIT_S` (then the pool's thread raises)."""
        with self._lock:
            while not all(w.ready for w in self._workers) and self._failure is None:
                self._lock.wait(1.0)
            self._raise_failure()

    def discard(self, call_id: int) -> None:
        """Forget a call (its queued tasks are not run, its running ones' results dropped)."""
        with self._lock:
            self._pending.pop(call_id, None)
            self._queue = deque(task for task in self._queue if task[0] != call_id)

    def close(self) -> None:
        """Stop the workers and the pool's thread; the pool cannot judge afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(10.0)
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(1.0 if worker.task is None else 0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
            worker.conn.close()
        self._workers = []

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _any_ready(self) -> bool:
        return any(w.ready for w in self._workers)

    def _wake(self) -> None:
        try:
            self._wake_write.send(None)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------------------ the pool's thread
    def _serve(self) -> None:
        """Send queued tasks to idle workers, take replies and deaths, until `close`."""
        while True:
            with self._lock:
                if self._closed:
                    return
                for worker in self._workers:
                    if worker.ready and worker.task is None and self._queue and worker.process.is_alive():
                        self._send(worker, self._queue.popleft())
                handles = [self._wake_read] + [w.conn for w in self._workers] + \
                          [w.process.sentinel for w in self._workers]
                limits = [w.sent_at + self.timeout_s + KILL_GRACE_S if w.task is not None
                          else w.started_at + STARTUP_LIMIT_S for w in self._workers if w.task is not None or
                          not w.ready]
            timeout = max(0.0, min(limits) - time.monotonic()) if limits else None
            wait(handles, timeout)
            while self._wake_read.poll():
                self._wake_read.recv()
            with self._lock:
                if self._closed:
                    return
                try:
                    for worker in list(self._workers):
                        self._collect(worker, time.monotonic())
                except JudgePoolError as error:
                    self._failure = error
                self._lock.notify_all()
                if self._failure is not None:
                    return

    def _send(self, worker: _Worker, task: tuple) -> None:
        worker.task, worker.sent_at = task, time.monotonic()
        try:
            worker.conn.send(task[3])
        except (OSError, EOFError):  # it died since it was last seen: `_collect` finds it gone
            pass

    def _collect(self, worker: _Worker, now: float) -> None:
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
            worker.process.join(1.0)  # the pipe closed: the process is ending
        if message is not None:
            kind = message[0]
            if kind == "ready":
                worker.ready, self._startup_deaths = True, 0
            elif kind == "failed":
                raise JudgePoolError(f"the judge workers cannot load the judge (data.judge.model="
                                     f"{self.fields.get('model')!r}): {message[1]}")
            elif worker.task is not None:
                (call_id, start, *_), worker.task = worker.task, None
                call = self._pending.get(call_id)
                if kind == "done":
                    _, verdicts, texts, began, ended = message
                    self.calls.append((worker.process.pid, began, ended))
                    if call is not None:
                        call.done[start] = (verdicts, texts)
                elif call is not None:  # the judge raised: the call fails as a raising reward does
                    call.error = RuntimeError(f"the judge raised in its worker: {message[1]}\n{message[2]}")
            return
        if not worker.ready and now > worker.started_at + STARTUP_LIMIT_S:
            raise JudgePoolError(f"a judge worker was not ready {STARTUP_LIMIT_S:g} s after it started (loading "
                                 f"data.judge.model={self.fields.get('model')!r} hangs?)")
        if not worker.process.is_alive():
            if worker.task is not None and worker.task[4] < RETRIES:  # it may have died before it began
                self._queue.appendleft(worker.task[:4] + (worker.task[4] + 1,))
                worker.task = None
            elif worker.task is not None:
                self._fail_task(worker, RewardCrash(f"the judge worker process ended (exit code "
                                                    f"{worker.process.exitcode}) during the call, "
                                                    f"{RETRIES + 1} times"))
            elif not worker.ready:
                self._startup_deaths += 1
                if self._startup_deaths >= STARTUP_DEATHS:
                    raise JudgePoolError(f"{STARTUP_DEATHS} judge workers in a row ended before they were ready (the "
                                         f"last: exit code {worker.process.exitcode}; its error is printed above)")
            self._replace(worker)
        elif worker.task is not None and now >= worker.sent_at + self.timeout_s + KILL_GRACE_S:
            self._fail_task(worker, RewardCrash(f"the judge did not answer within data.reward_timeout_s="
                                                f"{self.timeout_s:g} s (its worker was killed and replaced)"))
            self._replace(worker)

    def _fail_task(self, worker: _Worker, error: BaseException) -> None:
        call = self._pending.get(worker.task[0]) if worker.task else None
        if call is not None:
            call.error = error
        worker.task = None

    def _start_worker(self) -> None:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(target=serve_judge, name="scalerl-judge-worker", daemon=True,
                                        args=(child_conn, self.fields, self.device, self.threads, os.getpid()))
        process.start()
        child_conn.close()
        self._workers.append(_Worker(process, parent_conn, started_at=time.monotonic()))

    def _replace(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(1.0)
        worker.conn.close()
        self._workers.remove(worker)
        self.replaced += 1
        self._start_worker()


# The data.judge fields a worker rebuilds its judge from (plain values: the section itself is not sent).
_SECTION_FIELDS = ("model", "tokenizer", "template", "verdict", "max_score", "labels", "max_new_tokens",
                   "batch_size", "chat_template", "dtype", "engine")


def serve_judge(conn: Connection, fields: dict[str, Any], device: str, threads: int, parent_pid: int) -> None:
    """A worker's life: build the judge, say "ready", then judge each ``(prompts, completions, truths)``
    received, sending back ``("done", verdicts, raw answers, began, ended)``, until told to stop (None), the
    pipe closes or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="scalerl-judge-parent", daemon=True).start()
    try:
        import torch

        from scalerl.data.rewards.judge import judge_from_section

        if device == "cpu":
            torch.set_num_threads(threads)
        judge = judge_from_section(SimpleNamespace(**fields), device)
    except BaseException as error:  # the parent must hear why
        conn.send(("failed", f"{error!r}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        prompts, completions, truths = message
        began = time.monotonic()
        try:
            verdicts = judge(prompts, completions, ground_truth=truths)
            reply: tuple = ("done", verdicts, list(judge.last_texts), began, time.monotonic())
        except Exception as error:
            reply = ("raised", repr(error), traceback.format_exc())
        conn.send(reply)


def _add_forkserver_preload(context: Any) -> None:
    """Add `PRELOAD` to what the fork server imports when it starts (no effect on one running), keeping what
    others asked of it (e.g. `scalerl verify`'s trainer modules: one server serves them all). multiprocessing
    has no getter for the list, so it is read where the standard library keeps it, and replaced if absent."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or [])
    context.set_forkserver_preload(current + [name for name in PRELOAD if name not in current])


def _exit_when_orphaned(trainer_pid: int) -> None:
    """End the worker once the trainer's process is gone (a forked worker's parent is the fork server, so the
    trainer is watched by its pid; its closed pipe also ends a worker waiting for a call)."""
    while True:
        try:
            os.kill(trainer_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # alive, someone else's: not ours to judge
            pass
        time.sleep(1.0)


class PooledJudge:
    """The judge as a batched (TRL-style) reward whose calls run in a `JudgePool`: ``prefetch`` with a part's
    arguments starts its judging, the call with the same arguments later takes the verdicts (or starts and
    waits, where nothing was prefetched). ``last_texts`` holds the raw answers of the last call."""

    __name__ = "judge"
    keeps_own_process = True  # never sent to data.reward_workers: the judge has its own pool

    def __init__(self, pool: JudgePool):
        self.pool = pool
        self.last_texts: list[str] = []
        self._prefetched: dict[str, int] = {}  # the call's arguments (as text) -> its call id

    def prefetch(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> None:
        key = _call_key(prompts, completions, columns)
        if key not in self._prefetched:
            self._prefetched[key] = self.pool.submit(*_call_arguments(prompts, completions, columns))

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[Any]:
        call_id = self._prefetched.pop(_call_key(prompts, completions, columns), None)
        if call_id is None:
            call_id = self.pool.submit(*_call_arguments(prompts, completions, columns))
        try:
            verdicts, self.last_texts = self.pool.result(call_id)
        except BaseException:
            self.pool.discard(call_id)
            raise
        return verdicts

    def close(self) -> None:
        self.pool.close()


def _call_arguments(prompts: Sequence[Any], completions: Sequence[Any], columns: dict) -> tuple[list, list, list]:
    truths = columns.get("ground_truth") or [None] * len(prompts)
    return list(prompts), list(completions), list(truths)


def _call_key(prompts: Sequence[Any], completions: Sequence[Any], columns: dict) -> str:
    return repr(_call_arguments(prompts, completions, columns))


def pooled_judge_from_config(data_cfg: Any, device: Any) -> PooledJudge:
    """The judge ``data.judge`` describes in ``data.judge.workers`` processes, each on ``device``."""
    pool = JudgePool(data_cfg.judge, str(device), data_cfg.judge.workers, data_cfg.reward_timeout_s)
    try:
        pool.wait_ready()
    except BaseException:
        pool.close()
        raise
    return PooledJudge(pool)
