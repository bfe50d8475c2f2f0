"""Host RAM as the kernel counts it, for the doctor's host-RAM and phase-switch leaves: the node's memory a
run may use (MemTotal, or the container's cgroup limit when lower) and this process's resident set, now
and at its peak (VmHWM, which `reset_host_peak` brings back to the current resident set).

The files are module constants so a test can point them at a smaller, fake node (the doctor's memory-cap
fault injection) without a container."""

from __future__ import annotations

from pathlib import Path

from scalerl.perf.memory import proc_field_gib

MEMINFO = Path("/proc/meminfo")
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
# cgroup v2's limit of this container, then v1's; "max" or a huge v1 number means no limit.
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
GiB = 2**30


def host_rss_gb() -> float:
    """This process's resident set now (VmRSS), GiB; 0 where /proc is not readable."""
    return proc_field_gib(STATUS, "VmRSS") or 0.0


def host_peak_gb() -> float:
    """This process's peak resident set (VmHWM) since it started or since `reset_host_peak`, GiB."""
    return proc_field_gib(STATUS, "VmHWM") or 0.0


def reset_host_peak() -> bool:
    """Bring VmHWM back to the current resident set; False where the kernel refuses (the peak is then the
    process's lifetime peak, an over-estimate of the phase's)."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def cgroup_limit_gb() -> float | None:
    """The container's memory limit, GiB; None when there is none (or none readable)."""
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        if limit >= 2**60:  # cgroup v1 writes "no limit" as the largest page-aligned 64-bit number
            return None
        return limit / GiB
    return None


def node_memory_gb() -> dict[str, float | str]:
    """The memory a run on this node may use: ``total_gb`` (the lower of MemTotal and the cgroup limit) and
    ``source`` (which one it was)."""
    total = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024 / GiB  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    limit = cgroup_limit_gb()
    if limit is not None and (total is None or limit < total):
        return {"total_gb": limit, "source": "cgroup limit"}
    if total is None:
        raise OSError(f"no MemTotal in {MEMINFO}: the doctor reads the node's memory from it")
    return {"total_gb": total, "source": "MemTotal"}
