"""How a run that cannot go on ends: one `RunFailure` naming the cause and the last good checkpoint; and how
a run asked to stop ends (`StopSignals`, `RunStopped`: Ctrl-C, or SIGTERM from a scheduler).

Three causes are recognised here, at the trainer's boundary: a collective that failed because a peer froze or
died (described by `scalerl.parallel.distributed.describe_failure`: the collective, its group, this rank and
the ranks that went silent; under srun or mpirun nothing else would report it), a weight push to rollout
workers that stalled (`WeightSyncStalled`: the watchdog's record, worded by the doctor's leaf
``rollout/weight_sync_stall`` with its fix), and too many optimizer steps in a row skipped for a non-finite
gradient norm (the weights stopped changing: training is over in all but name).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
import torch.distributed as dist

from scalerl.checkpoint import list_checkpoints
from scalerl.comm.weights.channel import WeightSyncStalled
from scalerl.core.errors import RunFailure, UserError
from scalerl.health.rollout_rules import stall_failure_text
from scalerl.parallel.process_group import describe_failure, stop_heartbeat

if TYPE_CHECKING:
    from typing import Self  # Python 3.11 (annotations are not evaluated)

T = TypeVar("T")


def last_good_checkpoint(checkpoint_root: Path, before_step: int | None = None) -> str:
    """The newest complete checkpoint (of a step before `before_step`, when given) and how to resume from
    it, or why there is none."""
    try:
        found = list_checkpoints(checkpoint_root)
    except Exception as e:  # an unreadable folder must not hide the failure being reported
        return f"unknown ({checkpoint_root} cannot be read: {e})"
    if before_step is not None:
        found = [p for p in found if int(p.name.rsplit("_", 1)[-1]) < before_step]
    if not found:
        earlier = f" from before step {before_step}" if before_step is not None else " yet"
        return f"none{earlier} in {checkpoint_root} (trainer.save_every sets how often a run saves one)"
    resume = "trainer.resume=auto" if before_step is None else f"trainer.resume={found[-1]}"
    return f"{found[-1]} (continue from it with {resume})"


def run_reporting_failures(run: Callable[[], T], checkpoint_root: Path) -> T:
    """`run()`, with a collective failure turned into a RunFailure that says what happened and where the
    last good checkpoint is; this rank's heartbeat stops when the run ends either way."""
    try:
        return run()
    except (UserError, RunFailure):
        raise
    except WeightSyncStalled as error:  # the side and the bucket that stalled, and what to check
        raise RunFailure(f"{stall_failure_text(error.record)}. Last good checkpoint: "
                         f"{last_good_checkpoint(checkpoint_root)}") from error
    except Exception as error:
        described = describe_failure(error)
        if described is None:
            raise
        raise RunFailure(f"{described}. Last good checkpoint: {last_good_checkpoint(checkpoint_root)}") from error
    finally:
        stop_heartbeat()


class SkippedStepGuard:
    """Stops a run once `limit` optimizer steps in a row were skipped for a non-finite gradient norm (0:
    never). The last good checkpoint it names is the newest from before the skipping began: a checkpoint
    saved during the streak may already hold the weights that broke."""

    def __init__(self, limit: int, prefix: str, checkpoint_root: Path):
        self.limit, self.prefix, self.checkpoint_root = limit, prefix, checkpoint_root
        self.streak_began: int | None = None  # the training step in which the current streak started

    def after_step(self, step: int, consecutive_skips: int) -> None:
        if consecutive_skips == 0:
            self.streak_began = None
            return
        if self.streak_began is None:
            self.streak_began = step
        if self.limit and consecutive_skips >= self.limit:
            good = last_good_checkpoint(self.checkpoint_root, before_step=self.streak_began)
            raise RunFailure(
                f"the last {consecutive_skips} optimizer steps in a row (steps {self.streak_began}-{step}) were "
                f"skipped because the gradient norm was not finite ({self.prefix}/skipped_steps), so the weights no "
                f"longer change (trainer.max_skipped_steps={self.limit}); lower the learning rate, check rewards "
                f"and data for inf/NaN, or use trainer.precision=fp32. Last good checkpoint: {good}"
            )


class RunStopped(RunFailure):
    """A run stopped at a safe point by SIGINT or SIGTERM; its message is the one line the CLI prints (no
    ``error:``), its exit code the signal's conventional one (130 for SIGINT, 143 for SIGTERM)."""

    prefix = ""  # the CLI prints the message as it is: a stop asked for is not an error

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While entered, SIGINT and SIGTERM only note that the run should stop; the loop asks `agreed` between
    steps, so a step is never cut in half. Every rank must stop at the same step (a rank that stopped alone
    would leave the others waiting in a collective): `agreed` takes the largest signal number over the
    trainer ranks. A second SIGINT means "now": it raises KeyboardInterrupt where the run is."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0  # a second SIGINT sooner than this after the first is the same Ctrl-C, forwarded

    def __init__(self) -> None:
        self.received = 0  # the first signal's number; 0: none
        self.received_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A terminal's Ctrl-C reaches every process of the group, and torchrun forwards it to its ranks too:
        # a second SIGINT within REPEAT_S of the first is that echo, not the user pressing again.
        if self.received == signal.SIGINT and signum == signal.SIGINT \
                and time.monotonic() - self.received_at > self.REPEAT_S:
            raise KeyboardInterrupt
        if self.received == 0:
            self.received, self.received_at = signum, time.monotonic()
            if os.environ.get("RANK", "0") == "0":  # os.write: a print here could re-enter a print it interrupted
                os.write(2, f"{signal.Signals(signum).name}: stopping after this step (Ctrl-C again stops at "
                            "once, saving nothing)\n".encode())

    def agreed(self, distributed: bool, group: Any = None, device: torch.device | str = "cpu") -> int:
        """The signal every rank of ``group`` (None: the world) stops for, 0 for none; a run that is not
        ``distributed`` asks no one. Control traffic of a few bytes, not counted as a step's."""
        if not distributed:
            return self.received
        flag = torch.tensor([float(self.received)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def resume_command() -> str:
    """The command that continues this run: this one with trainer.resume=auto (and no trainer.resume or
    trainer.overwrite of its own), where the scalerl CLI started it alone; else a sentence saying so."""
    argv = sys.argv
    launched_by_cli = os.path.basename(argv[0]) in ("scalerl", "__main__.py") and "RANK" not in os.environ
    if not launched_by_cli or len(argv) < 2:
        return "the same command with trainer.resume=auto"
    kept = [a for a in argv[1:] if not a.startswith(("trainer.resume=", "trainer.overwrite="))]
    return shlex.join(["scalerl", *kept, "trainer.resume=auto"])


def stopped_message(signum: int, step: int, total_steps: int, saved: Path | None, not_saved_because: str,
                    checkpoint_root: Path) -> str:
    """The one line a stopped run ends with: the signal, the step, what was saved, how to continue."""
    if saved is not None:
        kept = f"saved checkpoint {saved}"
    else:
        last = last_good_checkpoint(checkpoint_root).split(" (")[0]
        kept = f"nothing saved ({not_saved_because}); last checkpoint: {last}"
    return (f"stopped by {signal.Signals(signum).name} after step {step} of {total_steps}: {kept}; "
            f"continue with: {resume_command()}")
