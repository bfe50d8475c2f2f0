"""The sandboxed Python tool (`scalerl.rollout.agent.sandbox`): what ordinary code, a traceback, endless loops,
a fork bomb, a flood of output and a memory hog each come back as, and what the code cannot reach (other
directories, our environment, the network, other processes). The isolation checks need root and skip, saying
why, without it. Every test ends with no zombie child of this process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import scalerl.rollout.agent.sandbox as sandbox_module
from scalerl.rollout.agent.sandbox import (
    ProcessSandbox,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    default_sandbox,
    python_tool,
    sandbox_from_spec,
)

FAST = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, processes=8)
FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"


class EchoSandbox:
    """A stand-in for a container or remote sandbox, loaded by `sandbox_from_spec` from this file."""

    def exec(self, code: str, limits: SandboxLimits) -> SandboxResult:
        return SandboxResult(stdout=code, stderr="", exit_code=0, timed_out=False, killed=None, truncated=False,
                             wall_s=0.0)


@pytest.fixture(scope="module")
def sandbox() -> ProcessSandbox:
    """The built-in sandbox with an interpreter the sandbox uid can run: ours, or the system's where ours
    lives somewhere `nobody` cannot read (here: under /root)."""
    try:
        return default_sandbox()
    except SandboxError as error:
        pytest.skip(str(error))


@pytest.fixture(autouse=True)
def no_zombie_left():
    yield
    zombies = []
    for pid, stat in _proc_stats():
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            zombies.append(pid)
    assert zombies == [], f"unreaped children of the test process: {zombies}"


def _proc_stats():
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                yield int(entry), Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # it ended while we looked


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append(int(entry))
    return found


def _needs(sandbox: ProcessSandbox, *features: str) -> None:
    missing = [f for f in features if f not in sandbox.isolation]
    if missing:
        pytest.skip(f"isolation {missing} not in use here: {sandbox.refused or 'not root'}")


def test_prints_and_exit_code(sandbox):
    result = sandbox.exec("print('hello')\nimport sys\nsys.exit(3)\n", FAST)
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "", 3)
    assert not result.timed_out and result.killed is None and not result.truncated
    assert result.as_tool_message() == "hello\n[exit code 3]"
    assert sandbox.exec("x = 1\n", FAST).as_tool_message() == "[no output]"


def test_exception_traceback_in_stderr(sandbox):
    result = sandbox.exec("def explode():\n    raise ValueError('boom')\n\nexplode()\n", FAST)
    assert result.exit_code == 1 and result.killed is None
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert "in explode" in result.stderr and result.stderr.rstrip().endswith("ValueError: boom")
    assert result.as_tool_message().endswith("ValueError: boom\n[exit code 1]")


def test_busy_loop_ends_at_the_cpu_limit(sandbox):
    # a wall limit far above the CPU limit: on a busy machine a CPU second takes several seconds of wall time
    limits = SandboxLimits(cpu_s=1, wall_s=10)
    result = sandbox.exec("while True:\n    pass\n", limits)
    assert result.killed == "cpu time" and result.timed_out and result.exit_code is None
    assert result.wall_s < limits.wall_s
    assert "cpu time limit" in result.as_tool_message()


def test_sleeping_loop_ends_at_the_wall_limit_keeping_what_it_printed(sandbox):
    started = time.monotonic()
    result = sandbox.exec("import time\nprint('started')\nwhile True:\n    time.sleep(1)\n", FAST)
    assert time.monotonic() - started < FAST.wall_s + 1
    assert result.killed == "wall time" and result.timed_out and result.exit_code is None
    assert result.stdout == "started\n"  # unbuffered: what it printed before the kill is kept


def test_fork_bomb_ends_that_call_only(sandbox):
    limits = SandboxLimits(cpu_s=1, wall_s=2, processes=6)
    started = time.monotonic()
    result = sandbox.exec(FORK_BOMB, limits)
    assert time.monotonic() - started < limits.wall_s + 1
    assert result.exit_code != 0
    assert "BlockingIOError" in result.stderr or result.killed is not None
    if sandbox.uid is not None:
        assert _processes_of(sandbox.uid) == []
    assert sandbox.exec("print('still here')", FAST).stdout == "still here\n"


def test_processes_the_code_leaves_behind_are_killed(sandbox):
    _needs(sandbox, "pid")  # a child in a session of its own escapes the process group, not the namespace
    code = "import subprocess\nsubprocess.Popen(['sleep', '30'], start_new_session=True)\nprint('left')\n"
    started = time.monotonic()
    result = sandbox.exec(code, FAST)
    assert result.stdout == "left\n" and time.monotonic() - started < 1.5
    if sandbox.uid is not None:
        assert _processes_of(sandbox.uid) == []


def test_concurrent_calls_each_have_their_own_process_budget(sandbox):
    _needs(sandbox, "user")
    code = ("import subprocess\nchildren = [subprocess.Popen(['sleep', '0.3']) for _ in range(3)]\n"
            "print(sum(child.wait() == 0 for child in children))\n")
    limits = SandboxLimits(cpu_s=2, wall_s=5, processes=4)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: sandbox.exec(code, limits), range(8)))
    assert [r.stdout for r in results] == ["3\n"] * 8, [r.as_tool_message() for r in results]


def test_flood_of_output_is_cut_in_the_middle(sandbox):
    limits = SandboxLimits(cpu_s=2, wall_s=5, output_bytes=1000)
    code = "import sys\nsys.stdout.write('a' * 5_000_000 + 'b' * 5_000_000)\nraise ValueError('the end')\n"
    result = sandbox.exec(code, limits)
    assert result.truncated and result.wall_s < 2
    head, marker, tail = result.stdout.partition("\n[... ")
    cut, _, tail = tail.partition(" bytes cut ...]\n")
    assert marker and set(head) == {"a"} and set(tail) == {"b"} and len(head) >= 250 and len(tail) >= 250
    assert int(cut) == 10_000_000 - len(head) - len(tail)
    assert result.stderr.rstrip().endswith("ValueError: the end")  # the traceback's end survives the flood
    assert len(result.stdout.encode()) + len(result.stderr.encode()) < limits.output_bytes + 100


def test_endless_printing_is_bounded_and_stopped(sandbox):
    result = sandbox.exec("while True:\n    print('spam')\n", SandboxLimits(cpu_s=5, wall_s=1, output_bytes=400))
    assert result.killed == "wall time" and result.truncated
    assert result.stdout.startswith("spam\n") and len(result.stdout) < 500


def test_memory_hog_ends_with_a_memory_error(sandbox):
    result = sandbox.exec("hog = bytearray(2 * 1024**3)\n", SandboxLimits(cpu_s=2, wall_s=4, memory_mb=256))
    assert result.killed == "memory" and result.exit_code == 1
    assert result.stderr.rstrip().endswith("MemoryError")
    assert "memory limit" in result.as_tool_message()


@pytest.fixture
def root_only_dir():
    """A directory owned by root with mode 0755, outside the places the sandbox sees as its own (/tmp)."""
    if os.geteuid() != 0:
        pytest.skip("not root: the code keeps our uid and may write wherever we may")
    base = next((b for b in ("/var/lib", "/opt", "/srv", "/run") if os.path.isdir(b) and os.access(b, os.W_OK)), None)
    if base is None:
        pytest.skip("no root-owned directory outside /tmp to test in")
    path = tempfile.mkdtemp(prefix="scalerl-sandbox-test-", dir=base)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def test_writes_outside_its_directory_fail(sandbox, root_only_dir):
    code = ("import os, sys\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\n"
            "for path in sys.argv[1:] or %r:\n"
            "    try:\n        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
            "    except OSError as error:\n        print('refused', type(error).__name__)\n")
    targets = [os.path.join(root_only_dir, "escaped.txt"), os.path.join(os.getcwd(), f"escaped-{uuid.uuid4().hex}")]
    try:
        result = sandbox.exec(code % (targets,), FAST)
        # refused: not permitted, or not there at all where the path lies under the sandbox's own /tmp (a
        # checkout under /tmp, as CI's may be, is out of its sight)
        lines = result.stdout.splitlines()
        assert lines[0] == "ok" and len(lines) == 3
        assert all(line in ("refused PermissionError", "refused FileNotFoundError") for line in lines[1:]), lines
        assert not any(os.path.exists(target) for target in targets)
    finally:
        Path(targets[1]).unlink(missing_ok=True)


def test_its_tmp_is_its_own_directory(sandbox):
    _needs(sandbox, "mount")
    name = f"scalerl-sandbox-leak-{uuid.uuid4().hex}"
    result = sandbox.exec(f"import os\nopen('/tmp/{name}', 'w').write('x')\nprint(sorted(os.listdir('/tmp')))\n", FAST)
    assert result.stdout == f"{['main.py', name]!r}\n"
    assert not os.path.exists(f"/tmp/{name}")  # gone with the call, never on the host's /tmp


def test_accelerator_devices_are_hidden(sandbox, root_only_dir):
    _needs(sandbox, "mount")
    # a stand-in for /dev/nvidia0: a file anyone may read and write, as the GPU device files usually are
    device = Path(root_only_dir, "nvidia0")
    device.write_text("the training's GPU")
    device.chmod(0o666)
    hiding = ProcessSandbox(python=sandbox.python)
    hiding.hidden_devices = [str(device)]
    code = f"print(repr(open({str(device)!r}).read()))\nopen({str(device)!r}, 'w').write('x')\n"
    assert hiding.exec(code, FAST).stdout == "''\n"
    assert device.read_text() == "the training's GPU"
    assert sandbox.exec(code, FAST).stdout == "\"the training's GPU\"\n"  # where not hidden it is reachable
    assert device.read_text() == "x"


def test_it_sees_only_its_own_processes(sandbox):
    _needs(sandbox, "pid", "proc")
    result = sandbox.exec("import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", FAST)
    assert result.stdout == "2 [1, 2]\n"  # the namespace's init and the code


def test_environment_has_none_of_ours(sandbox, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SCALERL_SANDBOX_SECRET", secret)
    result = sandbox.exec("import json, os\nprint(json.dumps(dict(os.environ)))\n", FAST)
    environment = json.loads(result.stdout)
    assert secret not in result.stdout and "SCALERL_SANDBOX_SECRET" not in environment
    assert set(environment) <= {"PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                "MKL_NUM_THREADS", "MALLOC_ARENA_MAX", "LC_CTYPE"}


@pytest.fixture
def listening_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


CONNECT = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
           "    print('connected')\nexcept OSError as error:\n    print('blocked', error)\n")


def test_network_is_unreachable(sandbox, listening_port):
    if not sandbox.network_isolated:
        pytest.skip(sandbox.network_note)
    assert sandbox.exec(CONNECT.format(port=listening_port), FAST).stdout.startswith("blocked")
    # the same code does reach our socket where the network is left alone: the check above can fail
    open_sandbox = ProcessSandbox(python=sandbox.python, isolate_network=False)
    assert not open_sandbox.network_isolated and "isolate_network=False" in open_sandbox.network_note
    assert open_sandbox.exec(CONNECT.format(port=listening_port), FAST).stdout == "connected\n"


def test_sandbox_from_spec():
    try:
        assert isinstance(sandbox_from_spec("process"), ProcessSandbox)  # ours, or the system's interpreter
    except SandboxError as error:  # none the sandbox uid can run: said, naming each tried
        assert sys.executable in str(error) and "no interpreter the sandbox can run" in str(error)
    for spec in (f"{__file__}:EchoSandbox", "tests.rollout.agent.test_sandbox:EchoSandbox"):
        loaded = sandbox_from_spec(spec)
        assert type(loaded).__name__ == "EchoSandbox" and loaded.exec("print(1)", FAST).stdout == "print(1)"
    for bad, why in (("docker", "expected 'process'"), ("no/such/file.py:Sandbox", "not found"),
                     ("no.such.module:Sandbox", "importing no.such.module failed"),
                     ("tests.rollout.agent.test_sandbox:Missing", "no Missing"),
                     ("tests.rollout.agent.test_sandbox:FAST", "no FAST with an exec")):
        with pytest.raises(SandboxError, match=why):
            sandbox_from_spec(bad)


def test_limits_must_be_positive():
    with pytest.raises(SandboxError, match="wall_s"):
        SandboxLimits(wall_s=0)


def test_a_refused_namespace_is_named_and_the_rest_kept(sandbox, monkeypatch):
    _needs(sandbox, "proc")
    # a kernel that refuses to mount a fresh /proc, played by a file system type that does not exist
    broken = sandbox_module._STUB.replace('b"/proc", b"proc"', 'b"/proc", b"no-such-fs"')
    assert broken != sandbox_module._STUB
    monkeypatch.setattr(sandbox_module, "_STUB", broken)
    degraded = ProcessSandbox(python=sandbox.python)
    assert degraded.isolation == tuple(f for f in sandbox.isolation if f != "proc")
    assert list(degraded.refused) == ["proc"] and "mount /proc" in degraded.refused["proc"]
    assert degraded.exec("print('ok')", FAST).stdout == "ok\n"


def test_unrunnable_interpreter_is_refused_at_construction():
    with pytest.raises(SandboxError, match="/no/such/python3"):
        ProcessSandbox(python="/no/such/python3")


def test_calls_from_threads_are_independent(sandbox):
    barrier = threading.Barrier(4)

    def run(i: int) -> str:
        barrier.wait(timeout=10)
        return sandbox.exec(f"print({i} * 2)", FAST).stdout

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4))) == ["0\n", "2\n", "4\n", "6\n"]


def test_the_python_tool_runs_the_models_code_in_the_sandbox(sandbox):
    """The agent's `python` tool: code as its one argument, what it printed (or how it ended) as the answer."""
    import asyncio

    from scalerl.rollout.agent.tools import call_tool

    tool = python_tool(sandbox, FAST)
    assert tool.schema()["function"]["parameters"]["required"] == ["code"]
    assert asyncio.run(call_tool(tool, {"code": "print(6 * 7)"})).content.strip() == "42"
    looped = asyncio.run(call_tool(tool, {"code": "while True:\n    pass\n"}))
    assert "time" in looped.content and not looped.timed_out  # the sandbox's limit ends it, not the tool's
