"""How a run that cannot go on ends: one `RunFailure` naming the cause and the last good checkpoint.

Two causes are recognised here, at the trainer's boundary: a collective that failed because a peer froze or
died (described by `scalerl.parallel.distributed.describe_failure`: the collective, its group, this rank and
the ranks that went silent; under srun or mpirun nothing else would report it), and too many optimizer
steps in a row skipped for a non-finite gradient norm (the weights stopped changing: training is over in
all but name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

from scalerl.checkpoint import list_checkpoints
from scalerl.core.errors import RunFailure, UserError
from scalerl.parallel.process_group import describe_failure, stop_heartbeat

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
