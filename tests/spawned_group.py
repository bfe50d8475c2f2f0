"""One helper for tests that need a multi-process world: spawn ``world_size`` processes on this machine,
join them into one gloo group on loopback, run a function in each, and hand back what each returned.

Start-up dominates such tests (a fresh process importing torch costs seconds on 2 cores), so a test module
spawns one group and does many checks inside it (e.g. through a module-scoped fixture), and the ranks are
forked from one server process that imported torch and the trainers once per test session (multiprocessing's
"forkserver", `start_method`): a clean process each, as with "spawn", without the import. What a forked rank
would otherwise take from that server rather than from the test, it is handed: the test's environment
(monkeypatched variables included) and its stdout/stderr (so pytest captures the ranks' output).
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalerl.core.net import free_port
from scalerl.verify import PRELOAD


def start_method() -> str:
    """The start method for a group's ranks: "forkserver" with `scalerl.verify.PRELOAD` imported (set here before
    its server starts, the one `scalerl verify` uses too; it lives until the test session ends). A name that
    fails to import there is skipped (a rank then imports it itself)."""
    mp.set_forkserver_preload(PRELOAD)
    return "forkserver"


class _ParentFd:
    """One of this process's file descriptors, handed to a rank as it starts (pickled with its arguments)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _child_fd, (DupFd(self.fd),)


def _child_fd(handle) -> int:
    return handle.detach()


def _parent_process_state() -> tuple[dict[str, str], _ParentFd, _ParentFd]:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return dict(os.environ), _ParentFd(1), _ParentFd(2)


def _adopting(rank: int, fn: Callable, parent_state: tuple[dict[str, str], int, int], *args: Any) -> Any:
    environ, stdout, stderr = parent_state
    os.environ.clear()
    os.environ.update(environ)
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    return fn(rank, *args)


def start_processes(fn: Callable[..., Any], args: tuple, nprocs: int, join: bool = True):
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join=join)` with each rank forked from the
    preloaded server (`start_method`) and handed this process's environment and stdout/stderr first."""
    return mp.start_processes(_adopting, args=(fn, _parent_process_state(), *args), nprocs=nprocs,
                              start_method=start_method(), join=join)


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple, results,
               init_group: bool = True) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    })
    torch.set_num_threads(1)  # two threads per process on two cores doubles step time
    faulthandler.enable(all_threads=True)  # a rank that crashes in C++ (SIGABRT, SIGSEGV) prints its Python stacks
    if not init_group:  # the function joins the ranks itself (e.g. the doctor's own rendezvous)
        results[rank] = fn(rank, *args)
        return
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    try:
        results[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


# A rank killed by one of these crashed inside torch's C++ (once in CI, in a gloo group: "terminate called
# without an active exception", not reproduced in 9 runs here, idle and loaded). The group is run once more and the
# crash reported as a warning with the ranks' stacks (faulthandler); a crash that repeats fails the test.
_CRASH_SIGNALS = {"SIGABRT", "SIGSEGV", "SIGBUS"}


def run_in_group(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
                 init_group: bool = True, may_vanish: tuple[int, ...] = ()) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each run in its own process of one gloo group.
    ``fn`` must be a module-level function and its result picklable. A rank that fails raises here; ranks
    still running after ``timeout_s`` are killed and named. ``init_group=False`` only sets the rendezvous
    variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT...) and leaves joining to ``fn``. Ranks in ``may_vanish``
    may end without a result (a test killing a process: ``os._exit(0)``); theirs is None. A group whose rank
    crashes by a signal in ``_CRASH_SIGNALS`` runs once more (warned); a second crash raises."""
    try:
        return _run_once(fn, world_size, args, timeout_s, init_group, may_vanish)
    except mp.ProcessExitedException as crash:
        if crash.signal_name not in _CRASH_SIGNALS:
            raise
        warnings.warn(f"rank {crash.error_index} of {fn.__name__} crashed with {crash.signal_name}; running the "
                      "group once more (its stacks are in the captured stderr)", RuntimeWarning, stacklevel=2)
        print(f"spawned_group: {crash}", file=sys.stderr)
        for arg in args:  # the retry starts from empty output folders; the crashed try's are kept beside them
            if isinstance(arg, (str, os.PathLike)) and os.path.isdir(arg):
                os.rename(arg, f"{os.fspath(arg)}.crashed")
                os.mkdir(arg)
        return _run_once(fn, world_size, args, timeout_s, init_group, may_vanish)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, init_group: bool,
              may_vanish: tuple[int, ...]) -> list[Any]:
    manager = mp.Manager()
    try:
        results = manager.dict()
        context = start_processes(_rank_main, (world_size, free_port(), timeout_s, fn, args, results, init_group),
                                  world_size, join=False)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    p.kill()
                raise TimeoutError(f"ranks {alive} of {fn.__name__} did not finish within {timeout_s:.0f} s")
        return [results.get(rank) if rank in may_vanish else results[rank] for rank in range(world_size)]
    finally:
        manager.shutdown()  # one server process per group, not one left behind per test module


def die_at_generate(call: int) -> None:
    """In a spawned rank: this process exits, as if killed, inside its ``call``-th generation with the built-in
    engine (after reading the request); a test then lists the rank in ``may_vanish``."""
    from scalerl.rollout.engines.builtin import BuiltinEngine

    original, calls = BuiltinEngine.generate, [0]

    def generate(self, prompts, sampling):
        calls[0] += 1
        if calls[0] == call:
            os._exit(0)
        return original(self, prompts, sampling)

    BuiltinEngine.generate = generate


def delay_later_rows(seconds: float) -> Callable[[], None]:
    """In a spawned rank: every generation with the built-in engine of rows that do not start at a batch's
    row 0 first sleeps ``seconds``, so a trainer gets the first rows' part before the others; returns the
    undo."""
    from scalerl.rollout.engines.builtin import BuiltinEngine

    original = BuiltinEngine.generate

    def generate(self, prompts, sampling):
        if sampling.row_offset:
            time.sleep(seconds)
        return original(self, prompts, sampling)

    BuiltinEngine.generate = generate
    return lambda: setattr(BuiltinEngine, "generate", original)


# A kernel's own words for "this CPU lacks the instruction set" (oneDNN: "bf16 path needs the cpu support
# avx_ne_convert or avx512bw, avx512vl and avx512dq"). scalerl probes before it takes such a path
# (`scalerl.core.cpu_capabilities`), so none should reach a test; if one does, it costs its case, not the group.
_MISSING_CPU_FEATURE = re.compile(r"needs the cpu support|not supported on (this|the current) (cpu|machine|hardware)"
                                  r"|illegal instruction", re.IGNORECASE)
UNSUPPORTED = "UNSUPPORTED_ON_THIS_CPU"


def missing_cpu_feature(error: BaseException) -> str | None:
    """The message of ``error`` (or of an error it wraps) where it says the CPU lacks a feature, else None."""
    seen: BaseException | None = error
    while seen is not None:
        if _MISSING_CPU_FEATURE.search(str(seen)):
            return f"{type(seen).__name__}: {str(seen).strip().splitlines()[0]}"
        seen = seen.__cause__ or seen.__context__
    return None


def run_case(out: str | os.PathLike, case: Callable[[], Any]) -> Any:
    """In a spawned rank: ``case()``, one of a group's several runs writing into ``out``. A case that fails
    because this CPU lacks a feature leaves ``out/UNSUPPORTED_ON_THIS_CPU`` (the reason) and the group goes on
    to its next case, so the tests of the other cases still run; its own tests skip (`skip_if_unsupported`).
    Any other failure fails the group as before. (Every rank of a group shares this machine's CPU, so they
    meet such an error alike.)"""
    try:
        return case()
    except Exception as error:
        why = missing_cpu_feature(error)
        if why is None:
            raise
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / UNSUPPORTED).write_text(why)
        print(f"spawned_group: case {Path(out).name} skipped: {why}", file=sys.stderr)
        return None


def skip_if_unsupported(run_dir: str | os.PathLike) -> None:
    """Skip the calling test, with the reason, where the group's case for ``run_dir`` met a missing CPU feature."""
    import pytest

    marker = Path(run_dir) / UNSUPPORTED
    if marker.exists():
        pytest.skip(f"case {Path(run_dir).name} needs what this CPU lacks: {marker.read_text()}")
