"""From a scalerl config to Kubernetes: the layout check, the manifest file, and `kubectl create`.

`job_for_config` checks that the pods' ranks fit the config's parallel layout before anything is written;
`submit_manifests` creates the objects with `kubectl create` (never `apply`: an existing job or config of the
same name is an error, not something to replace under a running job) and says how to follow the job.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from scalerl.core.config.tree import config_to_dict
from scalerl.launch.k8s import K8sError, K8sJob, check_job, trainer_ranks

KUBECTL_TIMEOUT_S = 60.0


def job_for_config(job: K8sJob, cfg: Any) -> K8sJob:
    """`job` with the resolved config and its rollout workers, once the ranks match `cfg.parallel`."""
    from scalerl.parallel.mesh import LayoutError, ParallelDims

    device = cfg.trainer.device
    if job.cpu_only and device == "cuda":
        raise K8sError("--cpu-only pods have no GPU, but the config sets trainer.device=cuda; drop --cpu-only "
                       "(and give --gpus-per-node) or set trainer.device=cpu")
    if not job.cpu_only and device == "cpu":
        raise K8sError(f"--gpus-per-node {job.gpus_per_node} asks for GPUs the config would not use "
                       "(trainer.device=cpu); set trainer.device=auto or cuda, or run CPU pods with --cpu-only")
    workers = cfg.rollout.workers if cfg.rollout.placement == "standalone" else 0
    job = replace(job, rollout_workers=workers, config_yaml=yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    check_job(job)
    ranks = trainer_ranks(job)
    per_node = "--cpu-only" if job.cpu_only else f"--gpus-per-node {job.gpus_per_node}"
    pods = f"--nodes {job.nodes} x {job.ranks_per_node} rank(s) per node ({per_node})"
    if workers and job.kind != "rayjob":
        pods += f" - {workers} standalone rollout worker(s) (rollout.workers)"
    if ranks < 1:
        raise K8sError(f"{pods} leaves no trainer rank")
    try:
        ParallelDims.from_config(cfg.parallel, ranks)
    except LayoutError as e:
        p = cfg.parallel
        raise K8sError(f"{pods} = {ranks} trainer ranks, which the config's layout parallel.dp_replicate="
                       f"{p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} pp={p.pp} cannot use: {e}") from None
    return job


def write_manifests(text: str, directory: str | Path, name: str) -> Path:
    """Write `<directory>/<name>.yaml`; an existing file is another run's and is never replaced."""
    path = Path(directory) / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x") as f:
            f.write(text)
    except FileExistsError:
        raise K8sError(f"{path} already exists; choose another --name or -o directory") from None
    return path


def _kubectl(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise K8sError("kubectl is not on PATH: install it (https://kubernetes.io/docs/tasks/tools/) or write the "
                       "manifests with --print or -o DIR and apply them elsewhere")
    try:
        return subprocess.run([kubectl, *args], input=stdin, capture_output=True, text=True, check=False,
                              timeout=KUBECTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise K8sError(f"kubectl {' '.join(args[:2])} did not answer within {KUBECTL_TIMEOUT_S:.0f} s "
                       "(is the cluster's API server reachable?)") from None


def submit_manifests(text: str, job: K8sJob) -> str:
    """Create the objects with kubectl; returns how to follow the job. Raises K8sError on any failure."""
    context = _kubectl(["config", "current-context"])
    if context.returncode != 0 or not context.stdout.strip():
        raise K8sError("kubectl has no current context (no cluster to submit to): pick one with "
                       f"`kubectl config use-context NAME` ({context.stderr.strip() or 'none set'})")
    created = _kubectl(["create", "-f", "-"], stdin=text)
    if created.returncode != 0:
        hint = (" (an object of that name exists: choose another --name, or delete the old job first)"
                if "AlreadyExists" in created.stderr else "")
        raise K8sError(f"kubectl create failed in context {context.stdout.strip()!r}{hint}: {created.stderr.strip()}")
    return created.stdout + follow_hint(job)


def follow_hint(job: K8sJob) -> str:
    ns, name = job.namespace, job.name
    resource = {"rayjob": "rayjob", "pytorchjob": "pytorchjob", "trainjob": "trainjob", "indexed-job": "job"}[job.kind]
    logs = {
        "rayjob": f"kubectl logs -n {ns} -f -l {_head(name)} -c ray-job-submitter",
        "pytorchjob": f"kubectl logs -n {ns} -f {name}-master-0",
        "trainjob": f"kubectl logs -n {ns} -f -l jobset.sigs.k8s.io/jobset-name={name}",
        "indexed-job": f"kubectl logs -n {ns} -f -l scalerl.io/job={name},batch.kubernetes.io/job-completion-index=0",
    }[job.kind]
    extra = f" service/{name}" if job.kind == "indexed-job" else ""
    policy = f" networkpolicy/{name}" if job.network_policy else ""
    return (f"follow:  kubectl get {resource} {name} -n {ns} -w\n"
            f"logs:    {logs}\n"
            f"delete:  kubectl delete -n {ns} {resource}/{name} configmap/{job.config_map}{extra}{policy}\n")


def _head(name: str) -> str:
    return f"scalerl.io/job={name},ray.io/node-type=head"
