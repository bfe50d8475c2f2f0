"""A peer that freezes (SIGSTOP) or dies (as a rank killed under srun, with no torchrun to notice) during a
collective: the surviving rank's run ends within `trainer.dist_timeout_s` in a RunFailure that names the
collective, its group, the scalerl call site, this rank, the silent rank (or rank 0, when the rank hosting the
job's store froze) and the last good checkpoint.

The ranks are started the way srun starts them (SLURM_* variables, no RANK/WORLD_SIZE) and form their group
through `init_distributed`, so the rendezvous limit, the collective limit and the heartbeats are the real
ones."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from scalerl.core.net import free_port
from tests.spawned_group import start_processes

COLLECTIVE_TIMEOUT_S = 3.0


def _rank_main(rank: int, port: int, scenario: str, out: str) -> None:
    os.environ.update({
        "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
    })
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    import torch

    from scalerl.core.config import ParallelSection
    from scalerl.core.errors import RunFailure
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.metric_reduction import reduce_metrics
    from scalerl.trainer.run_failures import run_reporting_failures

    torch.set_num_threads(1)
    ctx = init_distributed(ParallelSection(), torch.device("cpu"), dist_timeout_s=COLLECTIVE_TIMEOUT_S,
                           rendezvous_timeout_s=60)
    ctx.all_reduce(torch.ones(1))  # both ranks are in: the group works
    if rank == (0 if scenario == "master-freezes" else 1):
        if scenario != "die":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(9)  # killed: no exception, no goodbye
    time.sleep(0.5)
    start = time.monotonic()
    try:
        run_reporting_failures(lambda: reduce_metrics({"actor/pg_loss": 1.0}, ctx), Path(out) / "checkpoints")
        message = "no failure"
    except RunFailure as e:
        message = str(e)
    Path(out, "survivor.json").write_text(json.dumps({"message": message, "seconds": time.monotonic() - start}))


@pytest.mark.parametrize("scenario", ["freeze", "die", "master-freezes"])
def test_lost_peer_ends_the_run_naming_collective_rank_and_checkpoint(scenario, tmp_path):
    checkpoint = tmp_path / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text(json.dumps({"format_version": 1, "step": 4, "files": {}}))
    ranks = start_processes(_rank_main, (free_port(), scenario, str(tmp_path)), 2, join=False)
    survivor = 1 if scenario == "master-freezes" else 0
    try:
        ranks.processes[survivor].join(120)
        assert ranks.processes[survivor].exitcode == 0, f"rank {survivor} did not finish in time"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()  # SIGKILL also ends a stopped process
            process.join(10)
    result = json.loads((tmp_path / "survivor.json").read_text())
    message = result["message"]
    # torch 2.13's name for the tensor all-gather (all_gather_into_tensor before it)
    assert re.search(f"rank {survivor} of 2: collective all_gather_(single|into_tensor)", message), message
    assert "the default group (all 2 ranks)" in message and "metric_reduction.py" in message, message
    assert f"Last good checkpoint: {checkpoint}" in message and "trainer.resume=auto" in message, message
    if scenario == "master-freezes":  # rank 0 hosts the store the heartbeats go to
        assert "rank 0, which hosts the job's store at 127.0.0.1:" in message and "frozen or gone" in message
        return
    assert "ranks that stopped responding (frozen or gone): [1]" in message, message
    if scenario == "freeze":
        assert f"timed out after trainer.dist_timeout_s={COLLECTIVE_TIMEOUT_S:g} s" in message, message
        assert result["seconds"] < COLLECTIVE_TIMEOUT_S + 15  # the limit, plus a few heartbeats to name the rank
    else:
        assert "lost its connection to a peer" in message, message
        assert result["seconds"] < 15
