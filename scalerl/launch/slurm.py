"""Slurm batch scripts for scalerl jobs, their submission and waiting for them.

Two shapes, the ones verl / Megatron users write by hand:
- SPMD (default): `srun` starts one `python -m scalerl train` task per GPU (one per node on CPU), each
  reads its rank from Slurm's variables (`scalerl.core.rank_env`), and rank 0's node is the rendezvous.
- Ray on Slurm (`ray=True`): one `ray start` per node (head on the first), then one driver
  `python -m scalerl launch ray` on the head node, which places the ranks through Ray.
Every user string is shell-quoted; `#SBATCH` values, which sbatch (not the shell) reads, are refused
when they hold whitespace, quotes or control characters rather than quoted.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import time as time_module
from collections.abc import Mapping, Sequence
from pathlib import Path

from scalerl.core.errors import UserError
from scalerl.core.rank_env import SLURM_PORT_BASE, SLURM_PORT_SPAN

DEFAULT_RAY_PORT = 6379
# Job states after which squeue / scontrol will not change the outcome any more.
FINAL_JOB_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT",
})
_SBATCH_VALUE = re.compile(r"[^\s'\"\\`$;]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SlurmError(UserError, RuntimeError):
    """sbatch / squeue failed, or a job did not finish in time."""


def _sbatch_line(option: str, value: object) -> str:
    text = str(value)
    if not _SBATCH_VALUE.fullmatch(text):
        raise ValueError(f"--{option}={text!r}: #SBATCH values may not contain whitespace, quotes, '$', ';' "
                         "or backslashes")
    return f"#SBATCH --{option}={text}"


def _sbatch_header(*, job_name: str, nodes: int, ntasks_per_node: int, gpus_per_node: int,
                   cpus_per_task: int | None, mem: str | None, time: str, partition: str | None,
                   output: str, error: str, extra_sbatch: Sequence[str]) -> list[str]:
    lines = ["#!/bin/bash", _sbatch_line("job-name", job_name), _sbatch_line("nodes", nodes),
             _sbatch_line("ntasks-per-node", ntasks_per_node)]
    if gpus_per_node:
        lines.append(_sbatch_line("gres", f"gpu:{gpus_per_node}"))
    if cpus_per_task is not None:
        lines.append(_sbatch_line("cpus-per-task", cpus_per_task))
    if mem is not None:
        lines.append(_sbatch_line("mem", mem))
    lines += [_sbatch_line("time", time), _sbatch_line("output", output), _sbatch_line("error", error)]
    if partition is not None:
        lines.append(_sbatch_line("partition", partition))
    for option in extra_sbatch:
        # Whole options such as "--account=proj" or "--exclusive"; one per line, nothing a shell could see.
        if not option.startswith("-") or not _SBATCH_VALUE.fullmatch(option.replace("=", "", 1)):
            raise ValueError(f"extra sbatch option {option!r} must look like --name or --name=value "
                             "(no whitespace, quotes, '$', ';')")
        lines.append(f"#SBATCH {option}")
    return lines


def _env_lines(env: Mapping[str, str]) -> list[str]:
    lines = []
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r} is not a valid shell name")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    return lines


def _command(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(word)) for word in words)


def slurm_job_script(config_path: str | None, overrides: Sequence[str] = (), *, nodes: int = 1,
                     gpus_per_node: int = 0, ntasks_per_node: int | None = None, cpus_per_task: int | None = None,
                     mem: str | None = None, time: str = "01:00:00", partition: str | None = None,
                     job_name: str = "scalerl", output: str = "logs/%x-%j.out", error: str = "logs/%x-%j.err",
                     ray: bool = False, python: str = sys.executable, extra_sbatch: Sequence[str] = (),
                     env: Mapping[str, str] | None = None, master_addr: str | None = None,
                     ray_port: int = DEFAULT_RAY_PORT, ray_start_args: Sequence[str] = (),
                     ray_head_args: Sequence[str] = (), ray_launch_args: Sequence[str] = (),
                     ray_wait_s: int = 300) -> str:
    """The text of an sbatch script that trains `config_path` with `overrides` on `nodes` nodes.

    SPMD: one task per GPU (`gpus_per_node`), or one per node with 0 GPUs, unless `ntasks_per_node`
    is given; `srun --kill-on-bad-exit=1 python -m scalerl train ...` so one failed rank ends the job.
    Ray (`ray=True`): one task per node; the driver runs `scalerl launch ray ... --address HEAD:PORT`
    once `ray status` counts `nodes` active nodes (at most `ray_wait_s`; a `ray start` that dies ends the
    job at once). `ray_start_args` go to every `ray start`, `ray_head_args` to the head's only
    (e.g. `--include-dashboard=false`), `ray_launch_args` to the driver (e.g. `["--strategy", "SPREAD"]`).
    The driver gets the explicit head address rather than `auto`, which could find another Ray instance
    sharing the node.
    `MASTER_ADDR` is the job's first host (`scontrol show hostnames`; with Ray its IP address), or
    `master_addr` when node names do not resolve; `MASTER_PORT` is 15000 + job id % 20000, as
    `detect_rank_env` derives it. `env` is exported after those (so it may override them), e.g.
    `{"NCCL_DEBUG": "WARN"}`. Slurm does not create the folders of `output` / `error`: make them first.
    """
    if nodes < 1 or gpus_per_node < 0:
        raise ValueError(f"nodes must be >= 1 and gpus_per_node >= 0, got nodes={nodes}, gpus_per_node={gpus_per_node}")
    if ray and ntasks_per_node not in (None, 1):
        raise ValueError("Ray on Slurm runs one task (a ray node) per node; leave ntasks_per_node unset")
    tasks = 1 if ray else (ntasks_per_node or max(gpus_per_node, 1))
    lines = _sbatch_header(job_name=job_name, nodes=nodes, ntasks_per_node=tasks, gpus_per_node=gpus_per_node,
                           cpus_per_task=cpus_per_task, mem=mem, time=time, partition=partition, output=output,
                           error=error, extra_sbatch=extra_sbatch)
    config_words = ([config_path] if config_path else []) + list(overrides)
    lines += ["# Written by scalerl (scalerl.launch.slurm.slurm_job_script).", "set -euo pipefail", "",
              "# sbatch copies the submitting shell's environment; ranks must come from srun, not a stale RANK.",
              "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)']
    if master_addr is not None:
        lines.append(f"export MASTER_ADDR={shlex.quote(master_addr)}")
    elif ray:  # Ray wants the head's IP address, not its name
        lines.append('export MASTER_ADDR=$(srun --overlap --nodes=1 --ntasks=1 -w "$head_node" '
                     "hostname --ip-address | awk '{print $1}')")
    else:
        lines.append('export MASTER_ADDR="$head_node"')
    lines.append(f"export MASTER_PORT=$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))")
    lines += _env_lines(env or {})
    lines.append('echo "scalerl: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT"')
    lines.append("")
    if ray:
        lines += _ray_body(python, config_words, nodes, gpus_per_node, cpus_per_task, ray_port,
                           ray_start_args, ray_head_args, ray_launch_args, ray_wait_s)
    else:
        lines.append("srun --kill-on-bad-exit=1 " + _command([python, "-m", "scalerl", "train", *config_words]))
    return "\n".join(lines) + "\n"


def _ray_body(python: str, config_words: list[str], nodes: int, gpus_per_node: int, cpus_per_task: int | None,
              ray_port: int, ray_start_args: Sequence[str], ray_head_args: Sequence[str],
              ray_launch_args: Sequence[str], ray_wait_s: int) -> list[str]:
    """Head, workers, a bounded wait until all nodes joined, then the driver on the head node."""
    resources = [f"--num-gpus={gpus_per_node}"] + ([f"--num-cpus={cpus_per_task}"] if cpus_per_task else [])
    extra = _command([*resources, *ray_start_args])
    head_extra = _command(["--dashboard-host=127.0.0.1", *resources, *ray_start_args, *ray_head_args])
    ray = _command([str(Path(python).with_name("ray"))]) if "/" in python else "ray"
    # --overlap: the driver step shares the head node with the `ray start --head` step.
    step = 'srun --overlap --nodes=1 --ntasks=1 -w'
    return [
        f"ray_address=\"$MASTER_ADDR:{ray_port}\"",
        'export RAY_ADDRESS="$ray_address"',
        (f'{step} "$head_node" {ray} start --head --node-ip-address="$MASTER_ADDR" --port={ray_port} '
         f"{head_extra} --block &"),
        "ray_steps=($!)",
        "sleep 5  # let the head's GCS come up before workers dial it",
        'for worker in $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n +2); do',
        f'    {step} "$worker" {ray} start --address="$ray_address" {extra} --block &',
        "    ray_steps+=($!)",
        "done",
        "# Wait (bounded) until every node is an active Ray node; `ray status` lists them under Active.",
        f"deadline=$(( SECONDS + {int(ray_wait_s)} ))",
        "while true; do",
        '    for pid in "${ray_steps[@]}"; do',
        '        kill -0 "$pid" 2>/dev/null || { echo "scalerl: a ray start step exited early (see above)" >&2; exit 1; }',
        "    done",
        (f"    alive=$({ray} status --address=\"$ray_address\" 2>/dev/null | "
         "awk '/^Active:/{a=1;next} /^[A-Z][a-z ]*:/{a=0} a && /node_/{n++} END{print n+0}') || true"),
        f'    [ "$alive" -ge {nodes} ] && break',
        '    if [ $SECONDS -ge $deadline ]; then',
        f'        echo "scalerl: only $alive of {nodes} Ray nodes joined within {int(ray_wait_s)} s" >&2; exit 1',
        "    fi",
        "    sleep 2",
        "done",
        'echo "scalerl: $alive Ray nodes up at $ray_address"',
        f'{step} "$head_node" '
        + _command([python, "-m", "scalerl", "launch", "ray", *config_words, "--num-nodes", str(nodes),
                    "--gpus-per-node", str(gpus_per_node), *ray_launch_args])
        + ' --address="$ray_address"',
    ]


def submit(script_text: str, sbatch: str = "sbatch", script_path: str | Path | None = None) -> str:
    """Write the script (to `script_path`, or a temporary file) and submit it; returns the job id."""
    if script_path is None:
        with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="scalerl-", delete=False) as f:
            f.write(script_text)
            script_path = f.name
    else:
        Path(script_path).parent.mkdir(parents=True, exist_ok=True)
        Path(script_path).write_text(script_text)
    result = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SlurmError(f"{sbatch} --parsable {script_path} failed ({result.returncode}): "
                         f"{result.stderr.strip() or result.stdout.strip()}")
    # --parsable prints "jobid" or "jobid;cluster"
    return result.stdout.strip().split(";")[0]


def job_state(job_id: str, squeue: str = "squeue", scontrol: str = "scontrol") -> str | None:
    """The job's state (PENDING, RUNNING, COMPLETED, ...) or None once Slurm has forgotten it."""
    result = subprocess.run([squeue, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, check=False)
    state = result.stdout.strip() if result.returncode == 0 else ""
    if state:
        return state.split()[0]
    # squeue shows only live jobs; scontrol remembers finished ones for MinJobAge (300 s by default).
    result = subprocess.run([scontrol, "show", "job", "-o", str(job_id)], capture_output=True, text=True, check=False)
    match = re.search(r"\bJobState=(\S+)", result.stdout)
    return match.group(1) if match else None


def wait_for_job(job_id: str, timeout_s: float, poll_s: float = 0.2, squeue: str = "squeue",
                 scontrol: str = "scontrol") -> str:
    """Poll until the job leaves the queue; returns its final state (e.g. COMPLETED, FAILED).

    Polls every 0.2 s: `sbatch --wait` backs off to ~10 s between checks, which dominates short jobs.
    Returns "UNKNOWN" when Slurm no longer knows the job. Raises SlurmError after `timeout_s`.
    """
    deadline = time_module.monotonic() + timeout_s
    while True:
        state = job_state(job_id, squeue, scontrol)
        if state is None:
            return "UNKNOWN"
        if state in FINAL_JOB_STATES:
            return state
        if time_module.monotonic() >= deadline:
            raise SlurmError(f"Slurm job {job_id} still {state} after {timeout_s:g} s")
        time_module.sleep(poll_s)
