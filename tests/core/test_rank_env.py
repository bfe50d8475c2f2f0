"""detect_rank_env / apply_rank_env with fake environments, one per launcher."""

import os

import pytest

from scalerl.core.rank_env import (
    RankEnv,
    RankEnvError,
    apply_rank_env,
    detect_rank_env,
    expand_hostlist,
    parse_tasks_per_node,
)


@pytest.mark.parametrize("hostlist, hosts", [
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("gpu-[01-02]", ["gpu-01", "gpu-02"]),
    ("a1,b2", ["a1", "b2"]),
    ("node7", ["node7"]),
    ("n[08-10],login", ["n08", "n09", "n10", "login"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("gpu-[001-002],cpu[3]", ["gpu-001", "gpu-002", "cpu3"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n[3-1]", "n[a-b]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(RankEnvError, match="host list"):
        expand_hostlist(bad)


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(RankEnvError, match="tasks-per-node"):
        parse_tasks_per_node("2(3)")


def test_plain_process_is_none():
    assert detect_rank_env({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_torchrun():
    environ = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
               "MASTER_ADDR": "node0", "MASTER_PORT": "29400",
               "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}  # torchrun inside Slurm wins
    assert detect_rank_env(environ) == RankEnv(5, 8, 1, 4, 1, "node0", 29400, "torchrun")


def test_explicit_rank_defaults():
    env = detect_rank_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert env == RankEnv(1, 2, 0, 2, 0, "127.0.0.1", 29500, "torchrun")


def slurm_step(**extra):
    """Variables srun sets for task 3 of a 4-task, 2-node step (as seen on the test cluster)."""
    environ = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
               "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
               "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
               "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_NODELIST": "gpu-[07-08]"}
    environ.update(extra)
    return environ


def test_slurm_srun_step():
    env = detect_rank_env(slurm_step())
    assert env == RankEnv(3, 4, 1, 2, 1, "gpu-07", 15000 + 1234 % 20000, "slurm")


def test_slurm_master_from_env_and_uneven_tasks_per_node():
    environ = slurm_step(MASTER_ADDR="10.0.0.1", MASTER_PORT="29999", SLURM_PROCID="4", SLURM_NTASKS="5",
                         SLURM_STEP_NUM_TASKS="5", SLURM_NODEID="2", SLURM_LOCALID="0",
                         SLURM_STEP_TASKS_PER_NODE="2(x2),1", SLURM_JOB_NODELIST="a1,b2,c3")
    env = detect_rank_env(environ)
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank) == (4, 5, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29999)


def test_slurm_nodelist_fallback_and_ntasks_per_node():
    environ = slurm_step(SLURM_NTASKS_PER_NODE="2")
    for name in ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
        del environ[name]
    environ["SLURM_NODELIST"] = "n[3-4]"
    env = detect_rank_env(environ)
    assert (env.master_addr, env.local_world_size) == ("n3", 2)


def test_slurm_batch_script_itself_is_single_process():
    environ = slurm_step(SLURM_PROCID="0")
    del environ["SLURM_STEP_ID"]  # the batch shell: SLURM_PROCID=0 but no step
    assert detect_rank_env(environ) is None


def test_slurm_inconsistent_values_name_the_variables():
    with pytest.raises(RankEnvError, match=r"SLURM_PROCID=4 must be in \[0, SLURM_STEP_NUM_TASKS=4\)"):
        detect_rank_env(slurm_step(SLURM_PROCID="4"))
    with pytest.raises(RankEnvError, match="SLURM_LOCALID=2 .*SLURM_STEP_TASKS_PER_NODE=2"):
        detect_rank_env(slurm_step(SLURM_LOCALID="2"))
    with pytest.raises(RankEnvError, match="SLURM_NODEID=2 but SLURM_STEP_TASKS_PER_NODE"):
        detect_rank_env(slurm_step(SLURM_NODEID="2"))
    with pytest.raises(RankEnvError, match="SLURM_NTASKS='two' is not an integer"):
        detect_rank_env({k: v for k, v in slurm_step(SLURM_NTASKS="two").items() if k != "SLURM_STEP_NUM_TASKS"})


def test_torchrun_inconsistent_values():
    with pytest.raises(RankEnvError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        detect_rank_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RankEnvError, match="LOCAL_RANK=3 must be in"):
        detect_rank_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(RankEnvError, match="MASTER_PORT=70000"):
        detect_rank_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"})


def test_openmpi():
    environ = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "head", "MASTER_PORT": "23456"}
    assert detect_rank_env(environ) == RankEnv(6, 8, 2, 4, 1, "head", 23456, "openmpi")


def test_mpich_and_intel_mpi():
    environ = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
               "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500"}
    assert detect_rank_env(environ) == RankEnv(1, 2, 0, 1, 1, "10.1.1.1", 29500, "mpich")


def test_mpi_needs_master_addr_and_port():
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(RankEnvError, match="openmpi: MASTER_ADDR is not set"):
        detect_rank_env(environ)
    with pytest.raises(RankEnvError, match="mpich: MASTER_PORT is not set"):
        detect_rank_env({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(RankEnvError, match=r"OMPI_COMM_WORLD_RANK=3 must be in \[0, OMPI_COMM_WORLD_SIZE=2\)"):
        detect_rank_env({**environ, "OMPI_COMM_WORLD_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_apply_rank_env_exports_torch_names():
    environ = {}
    apply_rank_env(RankEnv(3, 4, 1, 2, 1, "gpu-07", 16234, "slurm"), environ)
    assert environ == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": "1", "MASTER_ADDR": "gpu-07", "MASTER_PORT": "16234"}
    assert detect_rank_env(environ) == RankEnv(3, 4, 1, 2, 1, "gpu-07", 16234, "torchrun")


def test_launcher_restart_count_and_job_id():
    from scalerl.core.rank_env import launcher_job_id, launcher_restart_count

    assert launcher_restart_count({}) == 0 and launcher_job_id({}) is None
    assert launcher_restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert launcher_restart_count({"SCALERL_RESTART_COUNT": "1"}) == 1
    with pytest.raises(RankEnvError, match="TORCHELASTIC_RESTART_COUNT='x'"):
        launcher_restart_count({"TORCHELASTIC_RESTART_COUNT": "x"})
    assert launcher_job_id({"SCALERL_JOB_ID": "abc", "TORCHELASTIC_RUN_ID": "r"}) == "scalerl:abc"
    assert launcher_job_id({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}) == "torchrun:r"
    # torchrun without --rdzv-id: its agent (the workers' parent, the same across restarts) names the job
    agent = launcher_job_id({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert agent.startswith("torchrun-agent:") and agent.endswith(f":{os.getppid()}")
