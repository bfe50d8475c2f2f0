"""What a failed collective was: its name, its group, where scalerl called it, and which ranks went silent.

gloo reports a frozen peer as "Timed out waiting 600000ms for recv operation to complete" and a dead one
as "Connection closed by peer [10.0.0.2]:4711"; neither names the collective or the rank. The traceback
does name the collective (the torch.distributed function it went through, with its `group` argument) and
the scalerl code that called it; the heartbeats (`rank_liveness`) name the ranks that stopped.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from scalerl.parallel.rank_liveness import RankHeartbeat

# Text of the errors gloo, NCCL and the TCP store raise when a peer stops or disappears mid-collective.
_FAILURE_SIGNATURES = (
    "Timed out waiting", "Connection closed by peer", "Connection reset by peer", "pair closure", "Broken pipe",
    "gloo/transport", "ProcessGroupNCCL", "NCCL error", "Watchdog caught collective operation timeout",
)
_TORCH_DISTRIBUTED = f"{Path(dist.__file__).parent}"
_SCALERL = str(Path(__file__).resolve().parents[1])
_WRAPPER_NAMES = ("wrapper", "inner", "_fn", "decorate_context")
_FACADE_FILES = (str(Path(__file__).resolve().parent / "distributed.py"),)


def is_collective_failure(error: BaseException) -> bool:
    """A peer froze or vanished under a collective (not a bug in the code that called it)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _FAILURE_SIGNATURES)


def failed_call(error: BaseException) -> tuple[str, str, str]:
    """(collective, its group, the scalerl call site) read from the error's traceback; "unknown" where absent."""
    frames = list(traceback.walk_tb(error.__traceback__))
    torch_frames = [(f, line) for f, line in frames if f.f_code.co_filename.startswith(_TORCH_DISTRIBUTED)]
    named = [(f, line) for f, line in torch_frames if f.f_code.co_name not in _WRAPPER_NAMES]
    collective, group = "unknown", "unknown"
    if named:
        entry = next((fl for fl in named if fl[0].f_code.co_filename.endswith("distributed_c10d.py")), named[0])
        collective = entry[0].f_code.co_name
        group = _describe_group(entry[0])
    caller = "unknown"
    first_torch = frames.index(torch_frames[0]) if torch_frames else len(frames)
    ours = [(f, line) for f, line in frames[:first_torch] if f.f_code.co_filename.startswith(_SCALERL)]
    # The counted facade (`DistContext.all_gather`...) is how every caller issues a collective: name the code
    # that called it, and the facade method it went through.
    callers = [(f, line) for f, line in ours if f.f_code.co_filename not in _FACADE_FILES] or ours
    if callers:
        frame, line = callers[-1]
        caller = f"{Path(frame.f_code.co_filename).relative_to(Path(_SCALERL).parent)}:{line} in {frame.f_code.co_name}"
        via = [f.f_code.co_name for f, _ in ours[ours.index((frame, line)) + 1:] if f.f_code.co_filename in _FACADE_FILES]
        if via:
            caller += f" (through DistContext.{via[0]})"
    return collective, group, caller


def _describe_group(frame: FrameType) -> str:
    if "group" not in frame.f_locals:
        return "unknown"
    group = frame.f_locals["group"]
    try:
        if group is None or group is dist.group.WORLD:
            return f"the default group (all {dist.get_world_size()} ranks)"
        return f"ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # the group may be half torn down by the failure itself
        return "unknown"


def describe_collective_failure(error: BaseException, rank: int, world_size: int, timeout_s: float | None,
                                heartbeat: RankHeartbeat | None) -> str:
    """One paragraph: what this rank was doing, what went wrong, and which ranks went silent."""
    collective, group, caller = failed_call(error)
    text = str(error)
    if "Timed out" in text or "timeout" in text.lower():
        what = "timed out" + (f" after trainer.dist_timeout_s={timeout_s:g} s" if timeout_s else "")
    else:
        what = "lost its connection to a peer"
    message = (f"rank {rank} of {world_size}: collective {collective} (group: {group}; called from {caller}) "
               f"{what}")
    if heartbeat is not None:
        report = heartbeat.silent_ranks()
        if not report.store_reachable:
            message += (f"; rank 0, which hosts the job's store at {heartbeat.master_addr}:{heartbeat.master_port}, "
                        "does not answer: it is frozen or gone")
        elif report.silent:
            message += f"; ranks that stopped responding (frozen or gone): {report.silent}"
        else:
            message += "; every other rank is still alive (a rank may be stuck elsewhere or took another path)"
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"{message}. torch said: {first_line[:300]}"
