"""How a run that cannot go on ends: repeated skipped optimizer steps stop it naming the last checkpoint
from before the skipping began (the collective failures are in tests/parallel/test_collective_failures.py);
and how a run asked to stop ends: SIGINT or SIGTERM mid-run stops `scalerl train` between steps with one
line and the signal's exit code, and `trainer.resume=auto` continues from the checkpoint it saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalerl.core.errors import RunFailure
from scalerl.core.net import free_port
from scalerl.trainer.rl_trainer import train
from scalerl.trainer.run_failures import SkippedStepGuard, last_good_checkpoint
from scalerl.trainer.update import OptimizerStep
from tests.tiny import tiny_overrides


def _checkpoint(root, step):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"format_version": 1, "step": step, "files": {}}))
    return path


def test_consecutive_skips_run_over_updates_and_reset_on_a_good_step():
    step = OptimizerStep(optimizer=None, grad_scaler=None, max_norm=1.0)
    step.count_skips([0.0, 1.0, 1.0])
    step.count_skips([1.0])
    assert step.consecutive_skips == 3
    step.count_skips([1.0, 0.0])
    assert step.consecutive_skips == 0


def test_guard_names_the_checkpoint_from_before_the_streak(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        _checkpoint(root, s)
    guard = SkippedStepGuard(limit=3, prefix="actor", checkpoint_root=root)
    guard.after_step(4, 0)
    guard.after_step(5, 1)  # the streak begins in step 5: step 6's checkpoint was saved during it
    guard.after_step(6, 2)
    with pytest.raises(RunFailure) as stopped:
        guard.after_step(7, 3)
    message = str(stopped.value)
    assert "steps 5-7" in message and "trainer.max_skipped_steps=3" in message and "actor/skipped_steps" in message
    assert f"Last good checkpoint: {root / 'step_00000004'}" in message
    assert f"trainer.resume={root / 'step_00000004'}" in message
    assert "none from before step 1" in last_good_checkpoint(root, before_step=1)
    SkippedStepGuard(limit=0, prefix="actor", checkpoint_root=root).after_step(9, 100)  # 0: never stops


def test_a_diverged_run_stops_instead_of_skipping_forever(tiny_config, length_reward):
    # lr=1e30 turns the weights non-finite after the first update; every later gradient is NaN.
    cfg = tiny_config(length_reward, "actor.lr=1e30", "trainer.total_steps=8", "trainer.max_skipped_steps=3",
                      "trainer.save_every=1", "rollout.max_new_tokens=8")
    with pytest.raises(RunFailure, match=r"optimizer steps in a row .* were skipped") as stopped:
        train(cfg)
    assert "Last good checkpoint: none from before step 1" in str(stopped.value)
    metrics = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(logged) < 8 and logged[-1]["actor/skipped_steps"] >= 1  # stopped early, after logging the step


def _steps_logged(run: Path) -> list[int]:
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _train_until_signalled(run: Path, signum: int, *overrides: str, launcher: tuple[str, ...] = ("-m", "scalerl")
                           ) -> subprocess.CompletedProcess:
    """`scalerl train` of many tiny steps, sent ``signum`` once its second step is logged: to the process, or,
    under a ``launcher`` such as torchrun, to its whole process group, as a terminal's Ctrl-C is."""
    command = [sys.executable, *launcher, "train",
               *tiny_overrides("trainer.total_steps=500", "data.num_val=0", *overrides), f"trainer.output_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    group = launcher[-1] != "scalerl"
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=group)
    deadline = time.monotonic() + 120
    while 2 not in _steps_logged(run) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_between_steps_saves_and_says_how_to_continue(tmp_path, signum):
    run = tmp_path / "run"
    stopped = _train_until_signalled(run, signum)
    assert stopped.returncode == 128 + signum  # 130 for SIGINT, 143 for SIGTERM
    assert "Traceback" not in stopped.stderr
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("stopped by")]
    step = max(_steps_logged(run))
    assert line.startswith(f"stopped by {signal.Signals(signum).name} after step {step} of 500: saved checkpoint "
                           f"{run / 'checkpoints' / f'step_{step:08d}'}; continue with: scalerl train ")
    assert line.endswith("trainer.resume=auto")
    # The resume continues after the saved step, without repeating one.
    resumed = subprocess.run([sys.executable, "-m", "scalerl", "train", *tiny_overrides(
        f"trainer.total_steps={step + 1}", "data.num_val=0"), f"trainer.output_dir={run}", "trainer.resume=auto"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps_logged(run) == list(range(1, step + 2))


def test_ctrl_c_under_torchrun_with_a_standalone_worker_stops_the_trainer_between_steps(tmp_path):
    """The worker gets the Ctrl-C too (and torchrun's forwarded copy): it keeps serving until the trainer has
    finished its step, saved and told it to stop, instead of dying and failing the trainer's step."""
    run = tmp_path / "run"
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                "-m", "scalerl")
    stopped = _train_until_signalled(run, signal.SIGINT, "rollout.placement=standalone", launcher=launcher)
    assert "stopped answering" not in stopped.stderr and "stopped at once" not in stopped.stderr, stopped.stderr[-3000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("stopped by")]
    step = max(_steps_logged(run))
    assert line.startswith(f"stopped by SIGINT after step {step} of 500: saved checkpoint "
                           f"{run / 'checkpoints' / f'step_{step:08d}'}")


def test_without_save_on_stop_nothing_new_is_saved_and_the_line_says_so(tmp_path):
    run = tmp_path / "run"
    stopped = _train_until_signalled(run, signal.SIGTERM, "trainer.save_on_stop=false")
    assert stopped.returncode == 143
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("stopped by")]
    assert "nothing saved (trainer.save_on_stop=false); last checkpoint: none" in line
    assert not list((run / "checkpoints").glob("step_*"))


def _agree_on_a_signal(rank: int):
    from scalerl.trainer.run_failures import StopSignals

    signals = StopSignals()
    first = signals.agreed(True)  # neither rank was signalled
    if rank == 1:
        signals.received = signal.SIGTERM  # as the handler notes it: only this rank got the scheduler's SIGTERM
    return first, signals.agreed(True)


def test_every_rank_stops_for_a_signal_any_rank_received():
    from tests.spawned_group import run_in_group

    assert run_in_group(_agree_on_a_signal, 2, timeout_s=120) == [(0, signal.SIGTERM), (0, signal.SIGTERM)]


def test_a_forwarded_ctrl_c_is_the_same_request_a_later_one_stops_at_once():
    from scalerl.trainer.run_failures import StopSignals

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a job started in the background
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C ...
        os.kill(os.getpid(), signal.SIGINT)  # ... and torchrun forwarding it, a moment later
        assert signals.received == signal.SIGINT  # noted, nothing raised: the loop stops at its next step
        signals.received_at -= StopSignals.REPEAT_S + 1  # the user presses again, later
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # restored on leaving


def test_a_stalled_weight_push_ends_the_run_with_the_leafs_words_and_the_checkpoint(tmp_path):
    from scalerl.comm.weights.channel import WeightSyncStalled
    from scalerl.trainer.run_failures import run_reporting_failures

    _checkpoint(tmp_path, 4)
    record = {"side": "trainer", "rank": 0, "sync": 5, "phase": "acks", "kind": "BUCKET", "bucket": 3, "buckets": 9,
              "tensors": ["layers.1.mlp.up.weight"], "bytes": 1000, "done": 5, "last_bucket": 2, "limit_s": 120.0,
              "limit_key": "weight_sync.timeout_s", "peers_read": True, "trainer_rank": 0, "error": "",
              "waiting_for": "every worker's acknowledgement of bucket 3 of 9",
              "stuck": [{"rank": 2, "state": "last completed bucket 2 of sync 5; now applying bucket 3 (for 130 s)"}]}

    def stalls():
        raise WeightSyncStalled(record)

    with pytest.raises(RunFailure) as failure:
        run_reporting_failures(stalls, tmp_path)
    text = str(failure.value)
    assert text.startswith("weight sync stalled (trainer rank 0 sending, sync 5): every worker's acknowledgement of "
                           "bucket 3 of 9 (tensors layers.1.mlp.up.weight)")
    assert "worker rank 2: last completed bucket 2" in text and "Fix: worker rank 2 stopped receiving at bucket 3" in text
    assert f"Last good checkpoint: {tmp_path / 'step_00000004'}" in text
