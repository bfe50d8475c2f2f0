"""Under `torchrun --max-restarts`, a rank killed mid-run (SIGKILL, after the step-2 checkpoint) restarts the
job, which continues from that checkpoint with the default trainer.resume=never: the final weights equal an
uninterrupted run's bitwise and metrics.jsonl has each step exactly once."""

import os
import subprocess
import sys

from scalerl.core.net import free_port
from tests.launch.restart_helpers import (
    assert_same_final_weights,
    logged_steps,
    write_reward,
)
from tests.tiny import tiny_overrides

RUN = tiny_overrides("trainer.total_steps=4", "trainer.save_every=2")


def torchrun(out, reward, max_restarts):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--max-restarts", str(max_restarts), "-m", "scalerl", "train", *RUN, reward, f"trainer.output_dir={out}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_killed_rank_restarts_from_the_latest_checkpoint(tmp_path):
    straight = torchrun(tmp_path / "straight", write_reward(tmp_path / "plain.py"), max_restarts=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    reward = write_reward(tmp_path / "killing.py", kill_after=tmp_path / "killed" / "checkpoints" / "step_00000002")
    killed = torchrun(tmp_path / "killed", reward, max_restarts=1)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert (tmp_path / "killing.killed").is_file()  # the kill happened
    assert "restart 1 of this job" in killed.stdout and "resumed from step 2" in killed.stdout
    assert logged_steps(tmp_path / "killed") == [0, 1, 2, 3, 4]
    assert_same_final_weights(tmp_path / "straight", tmp_path / "killed")
