"""`torchrun -m scalerl train` works as is: two ranks, DDP by default, rank 0 writes the metrics."""

import json
import os
import subprocess
import sys

from scalerl.core.net import free_port
from tests.tiny import TINY


def test_torchrun_two_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "scalerl", "train", *TINY, f"trainer.output_dir={tmp_path}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "balance/token_imbalance" in rows[1]  # two DP ranks: rollouts were rebalanced
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_torchrun_with_a_standalone_rollout_worker(tmp_path):
    """Three ranks: two train (DDP), the last one generates (rollout.placement=standalone)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           "-m", "scalerl", "train", *TINY, "rollout.placement=standalone", f"trainer.output_dir={tmp_path}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["comm/weight_sync_bytes"] > 0 and "balance/token_imbalance" in rows[1]
