"""A run's output directory: one run per directory, continued only when asked, never silently destroyed.

At the start of every RL or SFT run (`prepare_output_dir`, on every rank):

- ``trainer.resume=never`` into a directory that holds another run's outputs (checkpoints, metrics.jsonl,
  the exported model, TensorBoard events) is refused, naming what is there and the three ways on:
  ``trainer.resume=auto`` (continue it), ``trainer.overwrite=true`` (delete them first) or another
  ``trainer.output_dir``. A job restarted by its launcher (torchrun ``--max-restarts``, ``scalerl launch
  ray --max-restarts``) continues, as with ``resume=auto``, the directory its first attempt claimed
  (``.scalerl-job.json`` names the job), and nothing else.
- What interrupted saves left behind (``.tmp-*``, ``.old-*``, ``.del-*`` in the checkpoint root, the
  exported model's staging copies) is put right, and said.
- ``resume=auto`` names any newer checkpoint it passes over (unreadable meta.json) and the one it takes.

`resume_from_checkpoint` then loads it, prints "resumed from step N (path)" and, after a resume under
another layout, re-derives the RNG streams and records the change in the next checkpoints' meta.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scalerl import checkpoint
from scalerl.core.config import ConfigError
from scalerl.core.directory_swap import recover_leftovers, remove_directory
from scalerl.core.rank_env import launcher_job_id, launcher_restart_count
from scalerl.core.rng_state import reseed_after_reshard
from scalerl.models.hf_checkpoint import remove_interrupted_saves
from scalerl.parallel.distributed import DistContext

CHECKPOINTS_DIR = "checkpoints"
# What a run leaves in its output directory that a new run would overwrite or mix with.
RUN_OUTPUTS = (CHECKPOINTS_DIR, "metrics.jsonl", "final", "model", "tensorboard")
# Output directories trainer.overwrite=true deletes by renaming them aside first (`remove_directory`).
_DELETED_WHOLE = (CHECKPOINTS_DIR, "tensorboard")
# Which launcher job (`launcher_job_id`) started the run in this directory; its restarts continue it.
CLAIM_FILE = ".scalerl-job.json"
# Removed along with them by trainer.overwrite=true (a new run rewrites them anyway).
RUN_BYPRODUCTS = ("metrics.png", "config.yaml", CLAIM_FILE)


class OutputDirectoryInUse(ConfigError):
    """``trainer.output_dir`` holds another run's outputs and nothing says what to do with them."""


def say(ctx: DistContext, message: str, warning: bool = False) -> None:
    """One line from rank 0 (every rank knows the same things; one voice is enough)."""
    if ctx.is_main:
        print(f"warning: {message}" if warning else message, file=sys.stderr if warning else sys.stdout, flush=True)


def existing_outputs(output_dir: Path) -> list[str]:
    """The run outputs present in ``output_dir`` (an empty checkpoints/ does not count)."""
    found = []
    for name in RUN_OUTPUTS:
        path = output_dir / name
        if path.is_dir() and any(path.iterdir()) or path.is_file():
            found.append(name + ("/" if path.is_dir() else ""))
    return found


def prepare_output_dir(output_dir: Path, *, resume: str, overwrite: bool, export_dir: Path,
                       ctx: DistContext) -> Path | None:
    """Check, clean and claim ``output_dir`` for this run (collective); returns the checkpoint to resume or
    None. Raises `OutputDirectoryInUse` before anything is touched."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"trainer.output_dir {output_dir} exists and is not a directory")
    restarts, job = launcher_restart_count(), launcher_job_id()
    # A restart continues only a directory this very job claimed on its first attempt: a first attempt that
    # was refused must not become, on its restart, a run that continues someone else's outputs.
    # (Every rank sees the same resume and restart count, so every rank takes part in `agree` or none does.)
    if (str(resume).strip() == "never" and restarts > 0
            and ctx.agree(ctx.is_main and job is not None and _claimed_by(output_dir) == job)):
        say(ctx, f"restart {restarts} of this job by its launcher: continuing from the latest checkpoint "
                 f"in {output_dir} (as trainer.resume=auto)")
        resume = "auto"
    found = existing_outputs(output_dir) if str(resume).strip() == "never" else []
    if found and not overwrite:
        raise OutputDirectoryInUse(
            f"trainer.output_dir {output_dir} holds another run's outputs ({', '.join(found)}); refusing to "
            "overwrite them. Continue that run with trainer.resume=auto, replace it with trainer.overwrite=true "
            "(deletes them), or choose an empty trainer.output_dir"
        )
    ctx.barrier()  # every rank has looked before rank 0 changes anything
    if ctx.is_main:
        if found:
            _remove_outputs(output_dir)
            say(ctx, f"trainer.overwrite=true: deleted the previous run's {', '.join(found)} in {output_dir}")
        if job is not None:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / CLAIM_FILE).write_text(json.dumps({"job": job}) + "\n")
        root = output_dir / CHECKPOINTS_DIR
        repaired = (checkpoint.remove_interrupted_saves(root) + remove_interrupted_saves(export_dir)
                    + recover_leftovers(output_dir, lambda p: False, names=lambda n: n in _DELETED_WHOLE))
        if repaired:
            say(ctx, f"cleaned up after an interrupted save in {output_dir}: {'; '.join(repaired)}")
    ctx.barrier()  # rank 0's repairs (an old checkpoint moved back) are visible before anyone looks
    chosen = checkpoint.resolve_resume(resume, output_dir / CHECKPOINTS_DIR,
                                       report=lambda message: say(ctx, message, warning=True))
    if chosen is None and str(resume).strip() == "auto":
        say(ctx, f"trainer.resume=auto: no checkpoint in {output_dir / CHECKPOINTS_DIR}, starting at step 0")
    return chosen


def _claimed_by(output_dir: Path) -> str | None:
    try:
        return json.loads((output_dir / CLAIM_FILE).read_text()).get("job")
    except (OSError, ValueError, AttributeError):
        return None


def _remove_outputs(output_dir: Path) -> None:
    for name in RUN_OUTPUTS + RUN_BYPRODUCTS:
        path = output_dir / name
        if path.is_dir():
            remove_directory(path)
        elif path.exists():
            path.unlink()


def resume_from_checkpoint(path: Path, *, ctx: DistContext, seed: int, generators: dict[str, Any],
                           **state: Any) -> tuple[checkpoint.LoadedCheckpoint, list[dict[str, Any]]]:
    """Load ``path`` into the trainer's objects (``state``: model, optimizer, scheduler, ...) and say so;
    returns it with the run's reshard history (carried into the checkpoints it writes next)."""
    loaded = checkpoint.load(path, ctx=ctx, generators=generators, **state)
    history = list(loaded.meta.get("reshard_history") or [])
    message = f"resumed from step {loaded.step} ({loaded.path})"
    if loaded.resharded_from is not None:
        current = checkpoint.current_layout(ctx)
        reseed_after_reshard(seed, loaded.step, generators)
        history.append(checkpoint.reshard_record(loaded.step, loaded.resharded_from, current))
        message += (f", resharded from {_layout_text(loaded.resharded_from)} to {_layout_text(current)}: weights, "
                    "optimizer, scheduler and data position exact; RNG streams re-derived from (seed, step), "
                    "alike on every rank")
    say(ctx, message)
    return loaded, history


def _layout_text(layout: dict[str, Any]) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in layout["layout"].items() if v != 1)
    return f"world {layout['world_size']}" + (f" ({sizes})" if sizes else "")
