"""Kubernetes manifests for a scalerl run: KubeRay `RayJob`, Kubeflow `PyTorchJob` and `TrainJob`, or a
plain Indexed `Job` with a headless `Service`, each with the run's config in an immutable `ConfigMap`.

Every kind runs the same program as the other launchers on the same config:
- `rayjob`: a Ray cluster (a head that runs no ranks, one worker pod per node, and one pod per standalone
  rollout worker) whose entrypoint is `python -m scalerl launch ray CONFIG --address auto ...`;
- `pytorchjob` / `trainjob`: `torchrun --module scalerl train CONFIG` in every pod; the operator sets
  torchrun's `PET_*` variables (nodes, node rank, master);
- `indexed-job`: pod `i` is node `i` (`JOB_COMPLETION_INDEX`) and pod 0 is the master, reached through the
  headless Service as `<name>-0.<name>`; one GPU or none per pod runs `python -m scalerl train` directly
  (`scalerl.core.rank_env` reads the index), more run torchrun with `--node-rank=$(JOB_COMPLETION_INDEX)`.

Secrets are only ever references (`secretKeyRef`), never values. A `NetworkPolicy` admits traffic into the
job's pods only from the job's own pods (and, for a RayJob, the KubeRay operator to the dashboard port), since
torch's rendezvous store and Ray's dashboard take unauthenticated commands.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from scalerl.core.errors import UserError

K8S_KINDS = ("rayjob", "pytorchjob", "trainjob", "indexed-job")
CONFIG_DIR = "/etc/scalerl"
CONFIG_FILE = f"{CONFIG_DIR}/config.yaml"
JOB_LABEL = "scalerl.io/job"
GPU_RESOURCE = "nvidia.com/gpu"
RAY_DASHBOARD_PORT = 8265
KUBERAY_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # the KubeRay Helm chart's label
# The TrainJob's `torch-distributed` ClusterTrainingRuntime names its replicated job and container "node".
TRAINER_RUNTIME = "torch-distributed"
TRAINER_NODE = "node"
MAX_NAME_LENGTH = 40  # KubeRay appends a 5-character suffix and "-head-svc"; pods append "-<index>-<hash>"

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_LIKE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# An OCI image reference: [registry[:port]/]path[:tag][@digest], no whitespace or shell characters.
_IMAGE = re.compile(r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
                    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@[a-z0-9]+([+._-][a-z0-9]+)*:[0-9a-fA-F]{32,})?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")


class K8sError(UserError, ValueError):
    """A `scalerl launch k8s` option that cannot make a valid manifest; the message names the option."""


@dataclass(frozen=True)
class K8sJob:
    """What one `scalerl launch k8s` run asks for; `render_manifests` turns it into Kubernetes objects."""

    kind: str
    name: str
    image: str
    nodes: int
    gpus_per_node: int
    config_yaml: str  # the resolved run config, as `scalerl train` reads it
    namespace: str = "default"
    rollout_workers: int = 0  # standalone rollout ranks (the last ranks; a RayJob gives them their own pods)
    cpus_per_node: str | None = None
    memory_per_node: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # NAME -> (Secret, key)
    volumes: tuple[tuple[str, str], ...] = ()  # (PersistentVolumeClaim, mount path)
    image_pull_secret: str | None = None
    service_account: str | None = None
    active_deadline_s: int | None = None
    ttl_after_finished_s: int = 3600
    max_restarts: int = 0
    elastic_min_nodes: int | None = None  # pytorchjob only
    master_port: int = 29500
    cpus_per_rank: float = 1.0  # rayjob: what `scalerl launch ray` reserves per rank
    network_policy: bool = True
    cpu_only: bool = False  # pods without GPUs, one CPU rank each (gpus_per_node 0)

    @property
    def ranks_per_node(self) -> int:
        return max(self.gpus_per_node, 1)

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"


def check_job(job: K8sJob) -> None:
    """Raise K8sError naming the option of the first thing that no cluster would accept."""
    if job.kind not in K8S_KINDS:
        raise K8sError(f"--kind {job.kind!r}: expected one of {', '.join(K8S_KINDS)}")
    if len(job.name) > MAX_NAME_LENGTH or not _DNS_1035_LABEL.fullmatch(job.name):
        raise K8sError(f"--name {job.name!r}: must be a DNS label of at most {MAX_NAME_LENGTH} characters: lower-case "
                       "letters, digits and '-', starting with a letter and ending with a letter or digit")
    if len(job.namespace) > 63 or not _DNS_LABEL.fullmatch(job.namespace):
        raise K8sError(f"--namespace {job.namespace!r}: not a DNS label (at most 63 lower-case letters, digits "
                       "and '-', starting and ending with a letter or digit)")
    if not _IMAGE.fullmatch(job.image):
        raise K8sError(f"--image {job.image!r}: not an image reference such as registry.example.com/team/scalerl:1.0 "
                       "(no spaces or upper-case path letters)")
    if job.nodes < 1:
        raise K8sError(f"--nodes {job.nodes}: must be >= 1")
    if job.cpu_only and job.gpus_per_node:
        raise K8sError(f"--gpus-per-node {job.gpus_per_node} with --cpu-only: CPU pods have no GPUs; drop one of them")
    if not job.cpu_only and job.gpus_per_node < 1:
        raise K8sError(f"--gpus-per-node {job.gpus_per_node}: must be >= 1 (one rank per GPU); for pods without GPUs, "
                       "one CPU rank each, pass --cpu-only instead")
    for option, value in (("--cpus-per-node", job.cpus_per_node), ("--memory-per-node", job.memory_per_node)):
        if value is not None and not _QUANTITY.fullmatch(value):
            raise K8sError(f"{option} {value!r}: not a Kubernetes quantity such as 8, 500m, 64Gi")
    for name in (*job.env, *job.secret_env):
        if not _ENV_NAME.fullmatch(name):
            raise K8sError(f"environment variable name {name!r} is not a valid name")
    for name in job.env:
        if _SECRET_LIKE.search(name):
            raise K8sError(f"--env {name}=...: looks like a secret, which would be written into the manifest in "
                           f"the clear; store it in a Secret and pass --secret-env {name}=SECRET:KEY")
    for name, (secret, key) in job.secret_env.items():
        if not _DNS_LABEL.fullmatch(secret) or not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
            raise K8sError(f"--secret-env {name}={secret}:{key}: expected NAME=SECRET:KEY with a Secret's name and "
                           "one of its keys")
    for claim, path in job.volumes:
        if not _DNS_LABEL.fullmatch(claim) or not path.startswith("/") or ":" in path:
            raise K8sError(f"--pvc {claim}:{path}: expected CLAIM:/absolute/path with a PersistentVolumeClaim name")
    for option, value in (("--image-pull-secret", job.image_pull_secret), ("--service-account", job.service_account)):
        if value is not None and not _DNS_LABEL.fullmatch(value):
            raise K8sError(f"{option} {value!r}: not a DNS label")
    if job.active_deadline_s is not None and job.active_deadline_s < 1:
        raise K8sError(f"--active-deadline {job.active_deadline_s}: must be >= 1 second")
    if job.ttl_after_finished_s < 0 or job.max_restarts < 0:
        raise K8sError("--ttl-after-finished and --max-restarts must be >= 0")
    if job.elastic_min_nodes is not None:
        if job.kind != "pytorchjob":
            raise K8sError("--elastic-min-nodes applies to --kind pytorchjob only")
        if not 1 <= job.elastic_min_nodes <= job.nodes:
            raise K8sError(f"--elastic-min-nodes {job.elastic_min_nodes}: must be in [1, --nodes {job.nodes}]")


def trainer_ranks(job: K8sJob) -> int:
    """Ranks in the trainer's mesh: every pod's ranks, less the standalone rollout workers, which a RayJob
    places in pods of their own and the other kinds take from the last ranks of the world."""
    world = job.nodes * job.ranks_per_node
    return world if job.kind == "rayjob" else world - job.rollout_workers


# ---------------------------------------------------------------------------------------------- pod parts

def _labels(job: K8sJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "scalerl", JOB_LABEL: job.name}


def _env(job: K8sJob, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": k, "value": str(v)} for k, v in (extra or {}).items()]
    env += [{"name": k, "value": str(v)} for k, v in job.env.items()]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for k, (secret, key) in job.secret_env.items()]
    return env


def _resources(job: K8sJob, gpus: int) -> dict[str, Any]:
    amounts: dict[str, Any] = {}
    if gpus:  # quantities as strings, their serialized form (the Kubeflow SDK models accept no integers)
        amounts[GPU_RESOURCE] = str(gpus)
    if job.cpus_per_node:
        amounts["cpu"] = job.cpus_per_node
    if job.memory_per_node:
        amounts["memory"] = job.memory_per_node
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else {}


def _volumes(job: K8sJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts): the config, a RAM-backed /dev/shm (NCCL, data loaders) and the PVCs."""
    volumes: list[dict[str, Any]] = [{"name": "scalerl-config", "configMap": {"name": job.config_map}},
                                     {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "scalerl-config", "mountPath": CONFIG_DIR, "readOnly": True},
                                    {"name": "dshm", "mountPath": "/dev/shm"}]
    for i, (claim, path) in enumerate(job.volumes):
        volumes.append({"name": f"data-{i}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"data-{i}", "mountPath": path})
    return volumes, mounts


def _container(job: K8sJob, name: str, command: list[str] | None, gpus: int,
               env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """None for `command`: the image's or the operator's (KubeRay supplies `ray start`)."""
    container: dict[str, Any] = {"name": name, "image": job.image, **({"command": command} if command else {}),
                                 "env": _env(job, env_extra), "volumeMounts": _volumes(job)[1]}
    limits = _resources(job, gpus)
    if limits:
        container["resources"] = limits
    return container


def _pod_template(job: K8sJob, container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [container], "volumes": _volumes(job)[0], **spec}
    if job.image_pull_secret:
        pod["imagePullSecrets"] = [{"name": job.image_pull_secret}]
    if job.service_account:
        pod["serviceAccountName"] = job.service_account
    return {"metadata": {"labels": _labels(job)}, "spec": pod}


def _metadata(job: K8sJob, name: str | None = None) -> dict[str, Any]:
    return {"name": name or job.name, "namespace": job.namespace, "labels": _labels(job)}


def _train_command() -> list[str]:
    return ["python", "-m", "scalerl", "train", CONFIG_FILE]


def _torchrun_command(*args: str) -> list[str]:
    return ["torchrun", *args, "--module", "scalerl", "train", CONFIG_FILE]


# ---------------------------------------------------------------------------------------------- the kinds

def config_map(job: K8sJob) -> dict[str, Any]:
    # Immutable: a running job's mounted config can never change under it, and re-applying one with the
    # same name and other contents is refused by the API server.
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, job.config_map),
            "immutable": True, "data": {"config.yaml": job.config_yaml}}


def network_policy(job: K8sJob) -> dict[str, Any]:
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {JOB_LABEL: job.name}}}]}]
    if job.kind == "rayjob":  # the operator polls the job's status from the head's dashboard
        ingress.append({"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": KUBERAY_OPERATOR_LABELS}}],
                        "ports": [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata(job),
            "spec": {"podSelector": {"matchLabels": {JOB_LABEL: job.name}}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def ray_job(job: K8sJob) -> dict[str, Any]:
    entrypoint = shlex.join(["python", "-m", "scalerl", "launch", "ray", CONFIG_FILE, "--address", "auto",
                             "--num-nodes", str(job.nodes), "--gpus-per-node", str(job.gpus_per_node),
                             "--cpus-per-rank", f"{job.cpus_per_rank:g}"])
    # The head runs Ray's control plane and the driver only (num-cpus/gpus 0), so no rank lands on it.
    head = _pod_template(job, _container(job, "ray-head", None, 0))
    groups = [_ray_worker_group(job, "trainers", job.nodes, job.gpus_per_node)]
    if job.rollout_workers:
        groups.append(_ray_worker_group(job, "rollout", job.rollout_workers, min(job.gpus_per_node, 1)))
    spec: dict[str, Any] = {
        "entrypoint": entrypoint,
        # The submitter runs beside the head (KubeRay >= 1.5), so no extra pod reaches into the cluster.
        "submissionMode": "SidecarMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": job.ttl_after_finished_s,
        "rayClusterSpec": {
            "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
                              "template": head},
            "workerGroupSpecs": groups,
        },
    }
    if job.active_deadline_s is not None:
        spec["activeDeadlineSeconds"] = job.active_deadline_s
    if job.max_restarts:
        spec["backoffLimit"] = job.max_restarts
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _metadata(job), "spec": spec}


def _ray_worker_group(job: K8sJob, group: str, replicas: int, gpus: int) -> dict[str, Any]:
    template = _pod_template(job, _container(job, "ray-worker", None, gpus))
    return {"groupName": group, "replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas,
            "rayStartParams": {}, "template": template}


def pytorch_job(job: K8sJob) -> dict[str, Any]:
    def replica(count: int) -> dict[str, Any]:
        template = _pod_template(job, _container(job, "pytorch", _torchrun_command(), job.gpus_per_node))
        return {"replicas": count, "restartPolicy": "OnFailure" if job.max_restarts else "Never",
                "template": template}

    replicas = {"Master": replica(1)}
    if job.nodes > 1:
        replicas["Worker"] = replica(job.nodes - 1)
    run_policy: dict[str, Any] = {"cleanPodPolicy": "None", "ttlSecondsAfterFinished": job.ttl_after_finished_s,
                                  "backoffLimit": job.max_restarts}
    if job.active_deadline_s is not None:
        run_policy["activeDeadlineSeconds"] = job.active_deadline_s
    spec: dict[str, Any] = {"nprocPerNode": str(job.ranks_per_node), "pytorchReplicaSpecs": replicas,
                            "runPolicy": run_policy}
    if job.elastic_min_nodes is not None:
        spec["elasticPolicy"] = {"minReplicas": job.elastic_min_nodes, "maxReplicas": job.nodes,
                                 "maxRestarts": job.max_restarts, "rdzvBackend": "c10d"}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(job), "spec": spec}


def train_job(job: K8sJob) -> dict[str, Any]:
    volumes, mounts = _volumes(job)
    pod_patch: dict[str, Any] = {"volumes": volumes, "containers": [{"name": TRAINER_NODE, "volumeMounts": mounts}]}
    if job.image_pull_secret:
        pod_patch["imagePullSecrets"] = [{"name": job.image_pull_secret}]
    if job.service_account:
        pod_patch["serviceAccountName"] = job.service_account
    trainer: dict[str, Any] = {"image": job.image, "command": _torchrun_command(), "numNodes": job.nodes,
                               "numProcPerNode": job.ranks_per_node, "env": _env(job)}
    resources = _resources(job, job.gpus_per_node)
    if resources:
        trainer["resourcesPerNode"] = resources
    spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": TRAINER_RUNTIME},
        "trainer": trainer,
        "runtimePatches": [{"manager": "scalerl.io/launch", "trainingRuntimeSpec": {"template": {"spec": {
            "replicatedJobs": [{"name": TRAINER_NODE, "template": {"spec": {"template": {
                "metadata": {"labels": _labels(job)}, "spec": pod_patch}}}}]}}}}],
    }
    if job.active_deadline_s is not None:
        spec["activeDeadlineSeconds"] = job.active_deadline_s
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(job),
            "spec": spec}


def headless_service(job: K8sJob) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {JOB_LABEL: job.name},
                     "ports": [{"name": "rendezvous", "port": job.master_port, "protocol": "TCP"}]}}


def indexed_job(job: K8sJob) -> dict[str, Any]:
    master = {"MASTER_ADDR": f"{job.name}-0.{job.name}", "MASTER_PORT": str(job.master_port)}
    if job.ranks_per_node == 1:  # one rank per pod: scalerl reads JOB_COMPLETION_INDEX itself
        command = _train_command()
        extra = {**master, "WORLD_SIZE": str(job.nodes)}
    else:  # torchrun starts the pod's ranks; $(VAR) is expanded by the kubelet from the env below
        command = _torchrun_command(f"--nnodes={job.nodes}", f"--nproc-per-node={job.ranks_per_node}",
                                    "--node-rank=$(JOB_COMPLETION_INDEX)", "--master-addr=$(MASTER_ADDR)",
                                    "--master-port=$(MASTER_PORT)")
        extra = master
    container = _container(job, "scalerl", command, job.gpus_per_node, extra)
    # The index the Job controller writes on each pod, as an explicit variable so $(JOB_COMPLETION_INDEX) expands.
    container["env"].insert(0, {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
    template = _pod_template(job, container, restartPolicy="Never", subdomain=job.name)
    spec: dict[str, Any] = {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes,
                            "backoffLimit": job.max_restarts, "ttlSecondsAfterFinished": job.ttl_after_finished_s,
                            "template": template}
    if job.active_deadline_s is not None:
        spec["activeDeadlineSeconds"] = job.active_deadline_s
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job), "spec": spec}


def render_manifests(job: K8sJob) -> list[dict[str, Any]]:
    """The objects to create, in order: the ConfigMap first (pods mount it), then the policy and the job."""
    check_job(job)
    docs = [config_map(job)]
    if job.network_policy:
        docs.append(network_policy(job))
    if job.kind == "indexed-job":
        docs += [headless_service(job), indexed_job(job)]
    else:
        docs.append({"rayjob": ray_job, "pytorchjob": pytorch_job, "trainjob": train_job}[job.kind](job))
    return docs


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the config) as `|` blocks, so the ConfigMap reads like the config file."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text and not any(line != line.rstrip() for line in text.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def manifests_yaml(docs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(docs, Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False, width=120)
