"""The sandboxed Python tool: model-written code runs in a child process under limits (CPU and wall time,
memory, processes, file size, output), in a fresh directory it owns, with none of the caller's environment,
as `nobody` when we are root. As root it also gets, where the kernel allows, namespaces of its own
(`ProcessSandbox.isolation`): `user` (a process budget per call), `net` (no network), `pid` (its end ends
every process in it), `mount` (its directory seen as /tmp, /var/tmp and /dev/shm; accelerator devices
replaced by /dev/null) and `proc` (a /proc of its own processes only). `ProcessSandbox` is the built-in
sandbox; `sandbox_from_spec` loads any other object with `exec(code, limits)` (a container, a remote service).

The child is a small stub (`_STUB`, run by the sandbox's interpreter as the caller): it sets the limits,
enters the namespaces and forks the namespace's init, which drops to the sandbox uid and forks the code's
`python -I -u main.py`; the init's exit status comes back through the stub's own."""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import math
import os
import pwd
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from scalerl.core.errors import UserError

KILL_GRACE_S = 2.0  # after a SIGKILL (or the main process's exit), how long the pipes may take to close
STOP_GRACE_S = 1.0  # how long the stub may take to end the code at the wall time before it is killed too
READ_CHUNK = 65536
TIME_LIMITS = ("wall time", "cpu time")
_WANTED = ("user", "net", "pid", "mount", "proc")  # isolation features, each needs root; see `_STUB`
# Accelerators the training uses; their device files are usually world-writable (0666), so the code would
# otherwise reach them (and their memory) from any uid. "mount" puts /dev/null in their place.
_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*", "/dev/kfd", "/dev/accel/*")
# RLIMIT_AS counts reserved address space: thread pools (OpenBLAS, OpenMP) and glibc's per-thread malloc
# arenas reserve far more than they use, so one thread each keeps the memory limit about real use.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}

_STUB = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
features = set(cfg["features"])
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUSER, NEWPID, NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE, MS_NOSUID_NODEV_NOEXEC = 0x1000, 0x4000, 0x40000, 0xE

def check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "%s: %s" % (what, os.strerror(errno)))

def fail(error, code=125):
    sys.stderr.write("sandbox could not start: %s\n" % (error,))
    sys.stderr.flush()
    os._exit(code)

def drop_privileges():
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    check(libc.prctl(1, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")  # after setuid, which clears it

def run_init(to_stub, from_stub, status_w):
    # pid 1 of the new pid namespace (where there is one): when it exits the kernel kills all left in it
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # as pid 1 a signal without a handler cannot reach it
    if "proc" in features:
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID_NODEV_NOEXEC, None), "mount /proc")
    if "user" in features:
        # A user namespace of its own gives this call its own RLIMIT_NPROC count: the kernel counts
        # processes per (user namespace, uid), so concurrent calls as the same uid do not share one budget.
        check(libc.unshare(NEWUSER), "unshare(CLONE_NEWUSER)")
        os.write(to_stub, b"u")
        if os.read(from_stub, 1) != b"m":
            fail("no uid map")
    if cfg["nproc"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    drop_privileges()
    os.chdir(cfg["cwd"])
    user = os.fork()
    if user == 0:
        try:
            os.execv(cfg["python"], [cfg["python"], "-I", "-u", "main.py"])
        except OSError as error:
            fail("cannot run %s: %s" % (cfg["python"], error), 126)
    while True:
        pid, status = os.waitpid(-1, 0)  # reaps orphans re-parented to us as well
        if pid == user:
            os.write(status_w, b"%d" % status)
            os._exit(0)

init = 0

def stop(signum, frame):  # the caller's wall time ran out: end the namespace, then reap init ourselves
    try:
        os.kill(init, signal.SIGKILL) if init else os._exit(125)
    except OSError:
        pass

signal.signal(signal.SIGUSR1, stop)
try:
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    flags = ((NEWNET if "net" in features else 0) | (NEWPID if features & {"pid", "proc"} else 0)
             | (NEWNS if features & {"mount", "proc"} else 0))
    if flags:
        check(libc.unshare(flags), "unshare")
    if flags & NEWNS:  # private first: no mount below may reach the host's namespace
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    if "mount" in features:  # the world-writable places become the call's own directory
        for target in ["/dev/shm", "/var/tmp", "/tmp"]:
            if os.path.isdir(target):
                check(libc.mount(b".", target.encode(), None, MS_BIND, None), "mount --bind . " + target)
        for device in cfg["hidden"]:
            check(libc.mount(b"/dev/null", device.encode(), None, MS_BIND, None),
                  "mount --bind /dev/null " + device)
    proc_dir = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # this view of /proc outlives init's new one
    status_r, status_w = os.pipe()
    to_stub_r, to_stub_w = os.pipe()
    from_stub_r, from_stub_w = os.pipe()
    init = os.fork()
    if init == 0:
        try:
            for fd in (proc_dir, status_r, to_stub_r, from_stub_w):  # the stub's ends: EOF when it dies
                os.close(fd)
            run_init(to_stub_w, from_stub_r, status_w)
        except BaseException as error:
            fail(error)
    for fd in (status_w, to_stub_w, from_stub_r):
        os.close(fd)
    if "user" in features:
        if os.read(to_stub_r, 1) != b"u":
            os.waitpid(init, 0)
            os._exit(125)
        for name, own in (("uid_map", cfg["uid"]), ("gid_map", cfg["gid"])):
            fd = os.open("%d/%s" % (init, name), os.O_WRONLY, dir_fd=proc_dir)
            os.write(fd, b"%d %d 1" % (own, own))
            os.close(fd)
        os.write(from_stub_w, b"m")
    drop_privileges()
    if os.getppid() != cfg["parent"]:
        os._exit(125)  # the caller died before PR_SET_PDEATHSIG was in place
except OSError as error:
    fail(error)
report = b""
while True:
    chunk = os.read(status_r, 64)
    if not chunk:
        break
    report += chunk
os.waitpid(init, 0)
if not report:
    os._exit(125)
status = int(report)
if os.WIFSIGNALED(status):  # end as the code ended, so the caller sees the signal (SIGXCPU: cpu time)
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
os._exit(os.WEXITSTATUS(status))
'''


class SandboxError(UserError, ValueError):
    """A sandbox that cannot be had: a spec naming nothing with `exec`, an interpreter the sandbox uid cannot
    run, a limit that is not positive."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. `processes` counts the code's own processes (the sandbox's two helpers come on
    top); `output_bytes` bounds stdout and stderr together, cut in the middle."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 16
    file_size_mb: int = 16
    output_bytes: int = 16_384

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise SandboxError(f"SandboxLimits.{name} must be positive, got {value!r}")


@dataclass
class SandboxResult:
    """How one call ended. `killed` names the limit or signal that ended it ("wall time", "cpu time",
    "memory", "file size", "processes", "signal SIGSEGV"), None for an ordinary exit; `timed_out` is True
    for either time limit; `exit_code` is None when a signal or the wall time ended it."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    killed: str | None
    truncated: bool
    wall_s: float

    def as_tool_message(self) -> str:
        """What the model sees: stdout, then stderr, then how it ended when that was not a plain exit 0
        (already cut in the middle, with a marker saying how much, when it was too long)."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text.strip()]
        if self.killed == "wall time":
            parts.append(f"[killed: wall time limit reached after {self.wall_s:.1f} s]")
        elif self.killed == "cpu time":
            parts.append("[killed: cpu time limit reached]")
        elif self.killed is not None and self.killed.startswith("signal "):
            parts.append(f"[killed by {self.killed}]")
        elif self.killed is not None:
            parts.append(f"[ended: {self.killed} limit reached, exit code {self.exit_code}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


@runtime_checkable
class Sandbox(Protocol):
    """Anything that runs code under limits: `ProcessSandbox`, or a container or remote service of yours."""

    def exec(self, code: str, limits: SandboxLimits) -> SandboxResult: ...


class _Capture:
    """One stream, read whole but kept bounded: its first and last `keep // 2` bytes and its length."""

    def __init__(self, keep: int):
        self.head_cap, self.tail_cap = keep // 2, keep - keep // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        self.head += data[:room]
        self.tail += data[room:]
        del self.tail[:-self.tail_cap]

    def text(self, budget: int) -> str:
        kept = self.head + self.tail
        if self.total == len(kept) and self.total <= budget:
            return kept.decode("utf-8", "replace")
        head_from, tail_from = (kept, kept) if self.total == len(kept) else (self.head, self.tail)
        head = head_from[:budget // 2]
        tail = tail_from[len(tail_from) - (budget - budget // 2):]
        cut = self.total - len(head) - len(tail)
        # the marker of the tools' results (`tools._truncate_middle`), counted in bytes
        return f"{head.decode('utf-8', 'replace')}\n[... {cut} bytes cut ...]\n{tail.decode('utf-8', 'replace')}"


def _split_budget(out: _Capture, err: _Capture, budget: int) -> tuple[int, int]:
    """Bytes of stdout and of stderr to show: a stream shorter than half the budget leaves the rest to the
    other (a traceback after long output keeps its end)."""
    err_budget = min(err.total, max(budget // 2, budget - out.total))
    return budget - err_budget, err_budget


def _ended_by(returncode: int, stderr: str) -> str | None:
    if returncode < 0:
        sig = -returncode
        if sig in (signal.SIGXCPU, signal.SIGXFSZ):
            return "cpu time" if sig == signal.SIGXCPU else "file size"
        try:
            return f"signal {signal.Signals(sig).name}"
        except ValueError:  # a real-time signal has no name
            return f"signal {sig}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if returncode == 0 or not lines:
        return None
    # Python turns these limits into exceptions (it ignores SIGXFSZ); the traceback's last line names them.
    for pattern, limit in ((r"MemoryError\b", "memory"), (r"\[Errno 27\]", "file size"),
                           (r"^BlockingIOError: \[Errno 11\]", "processes")):
        if re.search(pattern, lines[-1]):
            return limit
    return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ProcessSandbox:
    """Runs each call in a child process (see the module's docstring). As root the code runs as `nobody` in
    its own namespaces; which of them the kernel allows is found once here by running a trivial program
    (`isolation` lists those in use, `refused` says why the others are not); `network_note` says in one
    line whether the network is cut, for the caller to report once at start."""

    def __init__(self, python: str = sys.executable, isolate_network: bool = True):
        self.python = python
        # As root, RLIMIT_NPROC would not hold (root is exempt) and the code could write anywhere, so it runs
        # as `nobody`, which owns its directory and nothing else; otherwise it keeps our uid.
        self.uid: int | None = None
        self.gid: int | None = None
        if os.geteuid() == 0:
            try:
                entry = pwd.getpwnam("nobody")
                self.uid, self.gid = entry.pw_uid, entry.pw_gid
            except KeyError:
                self.uid = self.gid = 65534
        self.hidden_devices = sorted(path for pattern in _DEVICES for path in glob.glob(pattern)
                                     if not os.path.isdir(path))
        wanted = tuple(f for f in _WANTED if f != "net" or isolate_network) if self.uid is not None else ()
        self.refused: dict[str, str] = {}
        self.isolation = wanted
        failure = self._start_failure()
        if failure is not None and wanted:
            self.isolation = ()
            failure = self._start_failure()  # without isolation: does the interpreter start at all?
            if failure is None:
                self._keep_permitted(wanted)
        if failure is not None:
            uid = self.uid if self.uid is not None else os.getuid()
            raise SandboxError(f"the sandbox cannot run {python} as uid {uid}: {failure} "
                               "(the interpreter and its library must be readable by that uid)")
        self.network_isolated = "net" in self.isolation
        if self.network_isolated:
            self.network_note = "sandboxed code runs in a new network namespace: no network, loopback down"
        elif not isolate_network:
            self.network_note = "sandboxed code has the host's network: isolate_network=False"
        else:
            why = self.refused.get("net", "a network namespace needs root (CAP_SYS_ADMIN)")
            self.network_note = f"sandboxed code has the host's network: no network namespace here ({why})"

    def _keep_permitted(self, wanted: tuple[str, ...]) -> None:
        for feature in wanted:  # which ones the kernel refuses; then the rest must work together
            self.isolation = (feature,)
            if (failure := self._start_failure()) is not None:
                self.refused[feature] = failure
        self.isolation = tuple(f for f in wanted if f not in self.refused)
        if self.isolation and (failure := self._start_failure()) is not None:
            self.refused.update(dict.fromkeys(self.isolation, f"refused together: {failure}"))
            self.isolation = ()

    def _start_failure(self) -> str | None:
        try:
            result = self.exec("print('ok')", SandboxLimits())
        except OSError as error:  # the interpreter itself cannot be started
            return str(error)
        return None if result.stdout == "ok\n" and result.exit_code == 0 else result.as_tool_message()

    def exec(self, code: str, limits: SandboxLimits) -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="scalerl-sandbox-")
        try:
            Path(workdir, "main.py").write_text(code, encoding="utf-8")
            if self.uid is not None:
                for path in (workdir, os.path.join(workdir, "main.py")):
                    os.chown(path, self.uid, self.gid)  # type: ignore[arg-type]
            return self._run(workdir, limits)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run(self, workdir: str, limits: SandboxLimits) -> SandboxResult:
        home = "/tmp" if "mount" in self.isolation else workdir  # "mount": the code sees its directory as /tmp
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", **_ONE_THREAD}
        cpu = max(1, math.ceil(limits.cpu_s))
        memory, file_size = limits.memory_mb << 20, limits.file_size_mb << 20
        config = {
            "features": self.isolation, "uid": self.uid, "gid": self.gid, "python": self.python,
            "parent": os.getpid(), "cwd": home, "hidden": self.hidden_devices,
            # SIGXCPU at the soft limit, SIGKILL a second later if the code ignores it
            "rlimits": [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory, memory),
                        ("RLIMIT_FSIZE", file_size, file_size), ("RLIMIT_CORE", 0, 0)],
            # + the stub and init; as our own uid the count would hold all our processes, so it is left alone
            "nproc": limits.processes + 2 if self.uid is not None else None,
        }
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        start = time.monotonic()
        process = subprocess.Popen([self.python, "-I", "-S", "-c", _STUB, json.dumps(config)], cwd=workdir,
                                   env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
        try:
            wall_hit = _collect(process, start + limits.wall_s, out, err)
        finally:
            process.stdout.close()  # type: ignore[union-attr]
            process.stderr.close()  # type: ignore[union-attr]
            try:
                returncode = process.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(process.pid)
                returncode = process.wait(timeout=KILL_GRACE_S)
        out_budget, err_budget = _split_budget(out, err, limits.output_bytes)
        stdout, stderr = out.text(out_budget), err.text(err_budget)
        killed = "wall time" if wall_hit else _ended_by(returncode, stderr)
        return SandboxResult(stdout=stdout, stderr=stderr,
                             exit_code=None if wall_hit or returncode < 0 else returncode,
                             timed_out=killed in TIME_LIMITS, killed=killed,
                             truncated=out.total > out_budget or err.total > err_budget,
                             wall_s=time.monotonic() - start)


def _collect(process: subprocess.Popen, deadline: float, out: _Capture, err: _Capture) -> bool:
    """Reads both pipes until they close and the stub has exited. At the deadline it asks the stub (SIGUSR1)
    to kill the namespace's init and reap it (a killed stub would leave that to the host's init, which may
    be slow to reap), then kills the whole process group if the stub has not gone within a grace. When the
    stub exits it kills the group too: strays the code left outside a pid namespace. The stub is not reaped
    here, so its group id cannot pass to another process while we signal it. Returns whether the deadline
    was hit."""
    pidfd = os.pidfd_open(process.pid)
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, out)  # type: ignore[arg-type]
    selector.register(process.stderr, selectors.EVENT_READ, err)  # type: ignore[arg-type]
    selector.register(pidfd, selectors.EVENT_READ, None)
    end, stage, exited = deadline, "running", False
    try:
        while selector.get_map():
            remaining = end - time.monotonic()
            if remaining <= 0:
                if exited or stage == "killed":
                    break  # the grace is spent: a pipe held by a process that escaped the group
                if stage == "running":
                    os.kill(process.pid, signal.SIGUSR1)
                    stage, end = "asked", time.monotonic() + STOP_GRACE_S
                else:
                    _kill_group(process.pid)
                    stage, end = "killed", time.monotonic() + KILL_GRACE_S
                continue
            for key, _ in selector.select(remaining):
                if key.data is None:
                    exited = True
                    selector.unregister(pidfd)
                    _kill_group(process.pid)
                    end = min(end, time.monotonic() + KILL_GRACE_S)
                elif chunk := os.read(key.fd, READ_CHUNK):
                    key.data.add(chunk)
                else:
                    selector.unregister(key.fileobj)
    finally:
        selector.close()
        os.close(pidfd)
    return stage != "running"


# Interpreters the sandbox's uid may be able to run where ours is not readable by it (a pyenv or venv
# under /root: `nobody` cannot read it): the system's own, tried in order after ours.
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


def default_sandbox(isolate_network: bool = True) -> ProcessSandbox:
    """A `ProcessSandbox` on the first interpreter the sandbox's uid can run: ours, else the system's."""
    failures = []
    for python in dict.fromkeys([sys.executable, *SYSTEM_PYTHONS]):
        if not os.path.exists(python):
            continue
        try:
            return ProcessSandbox(python, isolate_network)
        except SandboxError as error:
            failures.append(str(error))
    raise SandboxError("no interpreter the sandbox can run: " + "; ".join(failures) + " (install a system "
                       "python3, or make this one readable by the sandbox's uid)")


def sandbox_from_spec(spec: str) -> Sandbox:
    """"process" for `default_sandbox()`, or "module:Name" / "path/file.py:Name" naming a class (called with
    no arguments) or an object whose `exec(code, limits)` returns a `SandboxResult`."""
    if spec == "process":
        return default_sandbox()
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise SandboxError(f"sandbox spec {spec!r}: expected 'process', 'module:Class' or 'path/file.py:Class'")
    path = Path(where).resolve()
    # a file is imported once, under a name of our own, so a user's "sandbox.py" shadows nothing
    module_name = f"scalerl_user_sandbox_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    try:
        if not where.endswith(".py"):
            module = importlib.import_module(where)
        elif module_name in sys.modules:
            module = sys.modules[module_name]
        elif not path.is_file():
            raise SandboxError(f"sandbox spec {spec!r}: file {where} not found (relative to {Path.cwd()})")
        else:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = sys.modules[module_name] = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
            loader.loader.exec_module(module)  # type: ignore[union-attr]
    except SandboxError:
        raise
    except Exception as error:  # the user's module raised on import: say which and why
        sys.modules.pop(module_name, None)
        raise SandboxError(f"sandbox spec {spec!r}: importing {where} failed: {type(error).__name__}: {error}") \
            from error
    found = getattr(module, name, None)
    sandbox = found() if isinstance(found, type) else found
    if not callable(getattr(sandbox, "exec", None)):
        raise SandboxError(f"sandbox spec {spec!r}: {where} has no {name} with an exec(code, limits) method")
    return sandbox


def python_tool(sandbox: Sandbox, limits: SandboxLimits | None = None) -> Any:
    """The agent's ``python`` tool (`scalerl.rollout.agent.tools.Tool`): the model's code, its one argument,
    run by ``sandbox`` under ``limits``; the answer is what it printed, or how it ended. The tool's own
    timeout sits past the sandbox's wall limit, which ends the code first (and reaps it)."""
    from scalerl.rollout.agent.tools import Tool

    limits = limits or SandboxLimits()

    def run_python(code: str) -> str:
        return sandbox.exec(code, limits).as_tool_message()

    return Tool("python", "Run a Python program in a sandbox (no network, limited time and memory) and get what "
                "it printed.", {"type": "object", "properties": {"code": {"type": "string",
                                                                           "description": "the program"}},
                                "required": ["code"]}, run_python, timeout_s=limits.wall_s + 5.0)
