"""Slurm job scripts and the `scalerl launch` commands; then real jobs on a two-node Slurm cluster.

The cluster (scripts/slurm_test_cluster.sh: munged, slurmctld and two slurmd `n1`/`n2` on this machine)
is started once for the module and stopped at its end. Without Slurm installed, or if the daemons do
not come up, the cluster tests skip and say why.
"""

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest

from scalerl.launch.cli import add_launch_parser
from scalerl.launch.slurm import slurm_job_script, submit, wait_for_job
from tests.tiny import tiny_overrides

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm_test_cluster.sh"
TINY_TRAIN = tiny_overrides("actor.ppo_mini_batch_size=8")
# Ranks on one 2-core machine: one thread each, gloo on loopback (node names n1/n2 do not resolve).
TEST_JOB_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}


def bash_syntax_ok(script: str) -> None:
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# ---- the script text -------------------------------------------------------------------------------

def test_spmd_script_shape_and_quoting():
    script = slurm_job_script("/cfg/my run.yaml", ["actor.lr=1e-6", "data.prompt_template=Q: $(rm -rf /)"],
                              nodes=2, gpus_per_node=8, cpus_per_task=12, mem="200G", partition="gpu",
                              extra_sbatch=["--account=proj", "--exclusive"], python="/opt/py/bin/python",
                              env={"NCCL_DEBUG": "WARN it's"})
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --mem=200G", "#SBATCH --time=01:00:00",
                 "#SBATCH --output=logs/%x-%j.out", "#SBATCH --error=logs/%x-%j.err", "#SBATCH --job-name=scalerl",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --exclusive",
                 "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK",
                 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "export MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 20000 ))",
                 "export NCCL_DEBUG='WARN it'\"'\"'s'",
                 ("srun --kill-on-bad-exit=1 /opt/py/bin/python -m scalerl train '/cfg/my run.yaml' actor.lr=1e-6 "
                  "'data.prompt_template=Q: $(rm -rf /)'")]:
        assert line in script.splitlines(), line
    assert script.startswith("#!/bin/bash\n")
    bash_syntax_ok(script)


def test_cpu_script_one_task_per_node_unless_given():
    script = slurm_job_script("c.yaml", nodes=2, gpus_per_node=0)
    assert "#SBATCH --ntasks-per-node=1" in script and "--gres" not in script
    assert "#SBATCH --ntasks-per-node=4" in slurm_job_script("c.yaml", nodes=1, ntasks_per_node=4)


@pytest.mark.parametrize("kwargs", [{"job_name": "my job"}, {"partition": "gpu\n#SBATCH --x"},
                                    {"time": "$(date)"}, {"extra_sbatch": ["account=x"]},
                                    {"env": {"BAD NAME": "1"}}, {"nodes": 0}])
def test_script_rejects_unsafe_values(kwargs):
    with pytest.raises(ValueError):
        slurm_job_script("c.yaml", **kwargs)


def test_ray_script_shape():
    script = slurm_job_script("c.yaml", ["rollout.n=8"], nodes=3, gpus_per_node=4, cpus_per_task=32, ray=True,
                              python="/venv/bin/python")
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --gres=gpu:4" in script
    lines = script.splitlines()
    head = next(line for line in lines if "start --head" in line)
    assert head.startswith('srun --overlap --nodes=1 --ntasks=1 -w "$head_node" /venv/bin/ray start --head')
    assert head.endswith('--node-ip-address="$MASTER_ADDR" --port=6379 --dashboard-host=127.0.0.1 '
                         "--num-gpus=4 --num-cpus=32 --block &")
    assert any("ray start --address=\"$ray_address\" --num-gpus=4 --num-cpus=32 --block &" in line for line in lines)
    assert any("ray status" in line for line in lines) and "-ge 3 ]" in script
    assert lines[-1] == ('srun --overlap --nodes=1 --ntasks=1 -w "$head_node" /venv/bin/python -m scalerl launch ray '
                         'c.yaml rollout.n=8 --num-nodes 3 --gpus-per-node 4 --address="$ray_address"')
    bash_syntax_ok(script)
    with pytest.raises(ValueError, match="one task"):
        slurm_job_script("c.yaml", ray=True, ntasks_per_node=2)


# ---- the CLI ---------------------------------------------------------------------------------------

def launch_cli(argv):
    parser = argparse.ArgumentParser(prog="scalerl")
    add_launch_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_print(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  total_steps: 3\n")
    assert launch_cli(["launch", "slurm", str(config), "rollout.n=4", "trainer.output_dir=/data/out",
                       "--nodes", "2", "--gpus-per-node", "8", "--print"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --output=/data/out/logs/%x-%j.out" in script
    assert f"-m scalerl train {config} rollout.n=4 trainer.output_dir=/data/out" in script
    assert not Path("/data/out").exists()  # --print writes nothing


def test_cli_validates_config_before_anything():
    from scalerl.core.config import ConfigError

    with pytest.raises(ConfigError, match="actor.lrr"):
        launch_cli(["launch", "slurm", "actor.lrr=1", "--nodes", "1", "--print"])


def test_cli_submit_and_wait_with_fake_slurm(tmp_path, monkeypatch, capsys):
    """Default mode writes <output_dir>/slurm_job.sh and calls sbatch; --wait polls squeue/scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"sbatch": 'echo "$@" > "$(dirname "$0")/sbatch.args"; echo "77;cluster"',
                       "squeue": "exit 0", "scontrol": "echo 'JobId=77 JobState=COMPLETED Reason=None'"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "run"
    assert launch_cli(["launch", "slurm", f"trainer.output_dir={out}", "--nodes", "1", "--wait"]) == 0
    assert "submitted Slurm job 77" in capsys.readouterr().out
    assert (bin_dir / "sbatch.args").read_text().split() == ["--parsable", str(out / "slurm_job.sh")]
    assert "scalerl train trainer.output_dir=" in (out / "slurm_job.sh").read_text()
    assert (out / "logs").is_dir()


def test_cli_ray_calls_launch_ray(monkeypatch):
    calls = []
    fake = types.ModuleType("scalerl.launch.ray_launcher")
    fake.launch_ray = lambda config_path, overrides, **kw: calls.append((config_path, overrides, kw)) or 0
    monkeypatch.setitem(sys.modules, "scalerl.launch.ray_launcher", fake)
    assert launch_cli(["launch", "ray", "rollout.n=2", "--num-nodes", "2", "--gpus-per-node", "4",
                       "--strategy", "SPREAD", "--address", "auto"]) == 0
    expected = {"num_nodes": 2, "gpus_per_node": 4, "cpus_per_rank": 1.0, "strategy": "SPREAD", "address": "auto",
                "dashboard_host": "127.0.0.1", "max_restarts": 0, "connect_timeout_s": 30.0}
    assert calls == [(None, ["rollout.n=2"], expected)]


# ---- a real two-node cluster -----------------------------------------------------------------------

def free_port_pair() -> int:
    """A port p with p and p+1 both free (the two slurmd daemons take consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def slurm_cluster():
    """Start the two-node cluster (own ports, state under a fresh /tmp folder); yield its environment."""
    missing = [cmd for cmd in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(cmd) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing)}; "
                    "apt-get install slurmd slurmctld slurm-client munge)")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster needs root (slurmd and munged run as root / munge)")
    # munged wants every folder above its socket searchable by all; pytest's tmp folders are 0700.
    base = Path(tempfile.mkdtemp(prefix="scalerl-slurm-", dir="/tmp"))
    base.chmod(0o755)
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port_pair()), "SLURMD_PORT_BASE": str(free_port_pair()),
           "SLURM_CONF": str(base / "slurm.conf")}
    started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", str(base)], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
    try:
        if started.returncode != 0:
            pytest.skip(f"the test Slurm cluster did not start:\n{started.stdout}{started.stderr}")
        saved = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]  # submit()/wait_for_job() run sbatch/squeue with it
        try:
            yield base
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(base)], env=env, capture_output=True, timeout=60,
                       check=False)
        shutil.rmtree(base, ignore_errors=True)


# Runs in each task before the trainer: what this rank sees, and one gloo all_reduce across the nodes.
RANK_PROBE = textwrap.dedent("""\
    import json, os, sys
    import torch, torch.distributed as dist
    from scalerl.core.rank_env import apply_rank_env, detect_rank_env
    env = detect_rank_env()
    apply_rank_env(env)
    dist.init_process_group("gloo", init_method="env://")
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    record = dict(env.__dict__, slurm_nodeid=os.environ["SLURM_NODEID"], all_reduce=total.item())
    with open(os.path.join(sys.argv[1], f"rank{env.rank}.json"), "w") as f:
        json.dump(record, f)
""")


def run_job(script: str, tmp_path: Path, monkeypatch, timeout_s: float = 240) -> tuple[str, str]:
    """Submit, wait, and return (final state, the job's stdout + stderr)."""
    monkeypatch.setenv("RANK", "7")  # a stale rank in the submitting shell must not reach the tasks
    job_id = submit(script, script_path=tmp_path / "job.sh")
    state = wait_for_job(job_id, timeout_s=timeout_s)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"job-{job_id}.*")))
    return state, logs


def test_two_node_job_ranks_and_training(slurm_cluster, tmp_path, monkeypatch):
    """`--nodes=2 --ntasks-per-node=1`: each task's rank env and a cross-node all_reduce, then 2 GRPO steps.

    The job's `python` is a wrapper that first runs RANK_PROBE in the task (a stand-in rank check that
    does not depend on the trainer's own output), then execs the real `python -m scalerl train ...`.
    """
    (tmp_path / "probe.py").write_text(RANK_PROBE)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\n{sys.executable} {tmp_path / "probe.py"} {tmp_path} || exit 1\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    out_dir = tmp_path / "train"
    script = slurm_job_script(None, [*TINY_TRAIN, f"trainer.output_dir={out_dir}"], nodes=2, gpus_per_node=0,
                              time="00:05:00", output=str(tmp_path / "job-%j.out"),
                              error=str(tmp_path / "job-%j.err"), python=str(wrapper),
                              # a free port, not 15000 + job id: job ids restart at 1 on every test cluster
                              env={**TEST_JOB_ENV, "MASTER_PORT": str(free_port_pair())},
                              master_addr="127.0.0.1", job_name="scalerl-test")
    state, logs = run_job(script, tmp_path, monkeypatch)
    records = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"], r["node_rank"], r["slurm_nodeid"], r["launcher"]) for r in records] == \
        [(0, 2, 0, "0", "slurm"), (1, 2, 1, "1", "slurm")], logs
    assert all(r["all_reduce"] == 3.0 and r["local_rank"] == 0 and r["local_world_size"] == 1 for r in records)
    assert state == "COMPLETED", logs
    steps = [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps) - {0}) == [1, 2], steps
    assert len(steps) == len(set(steps)), f"metrics written by more than one rank: {steps}"


def test_two_node_job_with_a_standalone_rollout_worker(slurm_cluster, tmp_path, monkeypatch):
    """`--nodes=2 --ntasks-per-node=1` with rollout.placement=standalone: the trainer on n1, the rollout
    worker (the last rank) on n2, weights pushed across nodes every step."""
    out_dir = tmp_path / "train"
    script = slurm_job_script(None, [*TINY_TRAIN, "rollout.placement=standalone", f"trainer.output_dir={out_dir}"],
                              nodes=2, gpus_per_node=0, time="00:05:00", output=str(tmp_path / "job-%j.out"),
                              error=str(tmp_path / "job-%j.err"), python=sys.executable,
                              env={**TEST_JOB_ENV, "MASTER_PORT": str(free_port_pair())},
                              master_addr="127.0.0.1", job_name="scalerl-test")
    state, logs = run_job(script, tmp_path, monkeypatch)
    assert state == "COMPLETED", logs
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2], logs
    assert rows[-1]["comm/weight_sync_bytes"] > 0


def test_ray_on_slurm_job(slurm_cluster, tmp_path, monkeypatch):
    """Ray head on n1, a worker on n2, then the `scalerl launch ray` driver trains 2 steps, one rank on each."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'scalerl[ray]')")
    if importlib.util.find_spec("scalerl.launch.ray_launcher") is None:
        pytest.skip("scalerl.launch.ray_launcher is not in this tree yet")
    out_dir = tmp_path / "train"
    # A private Ray temp root: `ray start --head` records its address in <root>/ray/ray_current_cluster,
    # which plain `ray.init()` calls elsewhere on this machine would otherwise join (or trip on once stale).
    # Short (unix socket paths are limited to 107 bytes) and searchable, like the cluster folder.
    ray_tmp = slurm_cluster / "ray"
    script = slurm_job_script(None, [*TINY_TRAIN, f"trainer.output_dir={out_dir}"], nodes=2, gpus_per_node=0,
                              cpus_per_task=2, time="00:05:00", output=str(tmp_path / "job-%j.out"),
                              error=str(tmp_path / "job-%j.err"), ray=True, master_addr="127.0.0.1",
                              ray_port=free_port_pair(), job_name="scalerl-ray-test",
                              ray_start_args=["--object-store-memory=100000000"],
                              ray_head_args=["--include-dashboard=false"], ray_launch_args=["--strategy", "SPREAD"],
                              env={**TEST_JOB_ENV, "RAY_TMPDIR": str(ray_tmp), "RAY_AUTH_MODE": "disabled",
                                   "RAY_USAGE_STATS_ENABLED": "0",
                                   # sbatch exports this process's environment to the job, and another
                                   # test module sets this to 0, which makes `ray start` refuse workers.
                                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
                              ray_wait_s=120)
    state, logs = run_job(script, tmp_path, monkeypatch, timeout_s=300)
    assert state == "COMPLETED", logs
    assert "2 Ray nodes up" in logs and "on 2 node(s)" in logs, logs  # launch_ray reports the spread
    steps = [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps) - {0}) == [1, 2], steps
