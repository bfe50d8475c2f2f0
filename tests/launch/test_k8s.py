"""`scalerl launch k8s`: every kind renders, equals its golden file, validates against the real schemas
(tests/launch/k8s_schemas), round-trips through YAML and the operators' models, and bad input names the
option at fault. The Indexed Job's pod command and environment are run for real as two local ranks."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from scalerl.core.config import load_config
from scalerl.core.config.tree import config_to_dict
from scalerl.core.net import free_port
from scalerl.core.rank_env import RankEnvError, detect_rank_env
from scalerl.launch.k8s import (
    K8S_KINDS,
    K8sError,
    K8sJob,
    manifests_yaml,
    render_manifests,
)
from scalerl.launch.k8s_submit import job_for_config, submit_manifests, write_manifests
from tests.launch.k8s_schemas import (
    SchemaError,
    validate_core,
    validate_manifest,
    validate_pod_template,
    validate_pytorchjob,
    validate_rayjob,
    validate_trainjob,
)
from tests.tiny import TINY

GOLDEN = Path(__file__).parent / "golden" / "k8s"
CONFIG_YAML = "trainer:\n  total_steps: 100\n  output_dir: /runs/grpo-1\nparallel:\n  dp_shard: 8\n"


def golden_job(kind: str) -> K8sJob:
    """The job each golden file shows: 2 nodes x 8 GPUs, a Secret reference, a PVC for outputs."""
    job = K8sJob(kind=kind, name="grpo-qwen", image="registry.example.com/ml/scalerl:0.4", nodes=2, gpus_per_node=8,
                 config_yaml=CONFIG_YAML, namespace="rl", cpus_per_node="64", memory_per_node="512Gi",
                 env={"NCCL_DEBUG": "WARN"}, secret_env={"WANDB_API_KEY": ("wandb", "api-key")},
                 volumes=(("runs", "/runs"),), active_deadline_s=86400)
    if kind == "rayjob":
        job = replace(job, rollout_workers=2)  # a standalone rollout worker group
    if kind == "pytorchjob":
        job = replace(job, elastic_min_nodes=1, max_restarts=3)
    return job


def _docs(job: K8sJob) -> list[dict]:
    return render_manifests(job)


@pytest.mark.parametrize("kind", K8S_KINDS)
def test_each_kind_matches_its_golden_file(kind):
    text = manifests_yaml(_docs(golden_job(kind)))
    path = GOLDEN / f"{kind}.yaml"
    if os.environ.get("SCALERL_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; regenerate with SCALERL_UPDATE_GOLDEN=1 if intended"


@pytest.mark.parametrize("kind", K8S_KINDS)
@pytest.mark.parametrize("gpus", [1, 8])
def test_every_document_validates_against_the_published_schemas(kind, gpus):
    job = replace(golden_job(kind), gpus_per_node=gpus)
    docs = _docs(job)
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "ConfigMap" and kinds[1] == "NetworkPolicy"
    assert kinds[2:] == {"rayjob": ["RayJob"], "pytorchjob": ["PyTorchJob"], "trainjob": ["TrainJob"],
                         "indexed-job": ["Service", "Job"]}[kind]
    for doc in docs:
        validate_manifest(doc)


def test_cpu_only_pods_validate_and_request_no_gpu():
    for kind in K8S_KINDS:
        job = replace(golden_job(kind), gpus_per_node=0, cpu_only=True)
        docs = _docs(job)
        for doc in docs:
            validate_manifest(doc)
        assert "nvidia.com/gpu" not in manifests_yaml(docs)


@pytest.mark.parametrize("kind", K8S_KINDS)
def test_manifests_round_trip_through_yaml_and_the_operator_models(kind):
    docs = _docs(golden_job(kind))
    assert list(yaml.safe_load_all(manifests_yaml(docs))) == docs
    job_doc = docs[-1]
    if kind == "pytorchjob":
        from kubernetes.client import ApiClient

        model = validate_pytorchjob(job_doc)
        assert ApiClient().sanitize_for_serialization(model) == job_doc
    elif kind == "trainjob":
        model = validate_trainjob(job_doc)
        assert model.to_dict() == job_doc
    assert yaml.safe_load(docs[0]["data"]["config.yaml"]) == yaml.safe_load(CONFIG_YAML)


# ------------------------------------------------------------------ the validators reject what clusters reject

def _broken(doc: dict, path: list, key: str, value) -> dict:
    broken = copy.deepcopy(doc)
    node = broken
    for step in path:
        node = node[step]
    node[key] = value
    return broken


def test_validators_reject_unknown_fields_and_wrong_types():
    ray = _docs(golden_job("rayjob"))[-1]
    with pytest.raises(SchemaError, match="unknown field spec.rayClusterSpec.headGroupSpec.rayStartParam"):
        validate_rayjob(_broken(ray, ["spec", "rayClusterSpec", "headGroupSpec"], "rayStartParam", {}))
    with pytest.raises(SchemaError):
        validate_rayjob(_broken(ray, ["spec"], "shutdownAfterJobFinishes", "yes"))
    with pytest.raises(SchemaError, match="unknown field"):
        validate_rayjob(_broken(ray, ["spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec",
                                     "containers", 0], "imagePullPolice", "Always"))
    torch_job = _docs(golden_job("pytorchjob"))[-1]
    with pytest.raises(SchemaError, match="unknown field.*nprocsPerNode"):
        validate_pytorchjob(_broken(torch_job, ["spec"], "nprocsPerNode", "8"))
    with pytest.raises(SchemaError, match="unknown field"):
        validate_pytorchjob(_broken(torch_job, ["spec", "pytorchReplicaSpecs", "Master", "template", "spec",
                                                "containers", 0], "gpus", 8))
    with pytest.raises(SchemaError, match="expected int"):
        validate_pytorchjob(_broken(torch_job, ["spec", "pytorchReplicaSpecs", "Master"], "replicas", "one"))
    train = _docs(golden_job("trainjob"))[-1]
    with pytest.raises(SchemaError, match="unknown field.*numProcsPerNode"):
        validate_trainjob(_broken(train, ["spec", "trainer"], "numProcsPerNode", 8))
    with pytest.raises(SchemaError):
        validate_trainjob(_broken(train, ["spec", "trainer"], "numNodes", "two"))
    with pytest.raises(SchemaError):
        validate_trainjob(_broken(train, ["spec"], "runtimeRef", {"kind": "ClusterTrainingRuntime"}))  # no name
    job = _docs(golden_job("indexed-job"))[-1]
    with pytest.raises(SchemaError):
        validate_core(_broken(job, ["spec"], "completionMode", 3))
    with pytest.raises(SchemaError):
        validate_core(_broken(job, ["spec"], "indexed", True))
    with pytest.raises(SchemaError):
        validate_pod_template({"spec": {"containers": [{"name": "a", "gpus": 1}]}})


# ------------------------------------------------------------------ what the manifests say

def test_rayjob_runs_scalerl_launch_ray_with_the_pods_it_asks_for():
    ray = _docs(golden_job("rayjob"))[-1]
    spec = ray["spec"]
    assert spec["entrypoint"].startswith("python -m scalerl launch ray /etc/scalerl/config.yaml --address auto")
    assert "--num-nodes 2 --gpus-per-node 8" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["activeDeadlineSeconds"] == 86400
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    trainers, rollout = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert (trainers["replicas"], rollout["replicas"]) == (2, 2)
    assert trainers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert rollout["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for template in (head["template"], trainers["template"]):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
        assert volumes["scalerl-config"]["configMap"]["name"] == "grpo-qwen-config"


def test_secrets_are_references_never_values():
    for kind in K8S_KINDS:
        text = manifests_yaml(_docs(golden_job(kind)))
        assert "secretKeyRef:\n" in text and "name: wandb" in text and "key: api-key" in text
    with pytest.raises(K8sError, match="--secret-env WANDB_API_KEY=SECRET:KEY"):
        render_manifests(replace(golden_job("pytorchjob"), env={"WANDB_API_KEY": "abc123"}))
    with pytest.raises(K8sError, match="--secret-env HF_TOKEN=SECRET:KEY"):
        render_manifests(replace(golden_job("pytorchjob"), env={"HF_TOKEN": "hf_x"}))


def test_network_policy_admits_only_the_jobs_pods():
    policy = _docs(golden_job("pytorchjob"))[1]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"scalerl.io/job": "grpo-qwen"}}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"scalerl.io/job": "grpo-qwen"}}}]}]
    ray_policy = _docs(golden_job("rayjob"))[1]
    assert ray_policy["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert [d["kind"] for d in _docs(replace(golden_job("trainjob"), network_policy=False))] == ["ConfigMap", "TrainJob"]


# ------------------------------------------------------------------ bad input names the option

@pytest.mark.parametrize("change, option", [
    ({"gpus_per_node": 0}, "--gpus-per-node 0"),
    ({"image": "registry.example.com/ml/scalerl: 0.4"}, "--image"),
    ({"image": ""}, "--image"),
    ({"namespace": "RL_team"}, "--namespace 'RL_team'"),
    ({"namespace": "-rl"}, "--namespace"),
    ({"name": "Grpo"}, "--name 'Grpo'"),
    ({"name": "a" * 41}, "--name"),
    ({"nodes": 0}, "--nodes 0"),
    ({"cpus_per_node": "lots"}, "--cpus-per-node"),
    ({"memory_per_node": "64 GB"}, "--memory-per-node"),
    ({"volumes": (("runs", "relative/path"),)}, "--pvc runs:relative/path"),
    ({"secret_env": {"WANDB_API_KEY": ("Wandb Secret", "k")}}, "--secret-env WANDB_API_KEY"),
    ({"elastic_min_nodes": 3}, "--elastic-min-nodes 3"),
    ({"active_deadline_s": 0}, "--active-deadline"),
    ({"kind": "mpijob"}, "--kind 'mpijob'"),
])
def test_bad_options_are_errors_naming_the_option(change, option):
    with pytest.raises(K8sError) as e:
        render_manifests(replace(golden_job("pytorchjob"), **change))
    assert option in str(e.value)


def test_ranks_must_match_the_configs_layout():
    cfg = load_config(None, ["parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.tp=2"])  # 4 ranks
    base = K8sJob(kind="pytorchjob", name="x", image="img:1", nodes=1, gpus_per_node=4, config_yaml="")
    assert job_for_config(base, cfg).nodes == 1
    with pytest.raises(K8sError) as e:
        job_for_config(replace(base, nodes=2), cfg)
    message = str(e.value)
    assert "--nodes 2 x 4 rank(s) per node (--gpus-per-node 4)" in message and "8 trainer ranks" in message
    assert "parallel.dp_replicate=1 dp_shard=2 tp=2 pp=1" in message
    # Standalone rollout workers take the last ranks of a torchrun-started world, and pods of their own in Ray.
    cfg = load_config(None, ["parallel.dp_replicate=-1", "rollout.placement=standalone", "rollout.workers=1",
                             "parallel.tp=2"])
    with pytest.raises(K8sError, match="1 standalone rollout worker"):
        job_for_config(replace(base, nodes=1, gpus_per_node=4), cfg)  # 3 trainer ranks cannot hold tp=2
    assert job_for_config(replace(base, nodes=1, gpus_per_node=5), cfg).rollout_workers == 1
    ray = job_for_config(replace(base, kind="rayjob", nodes=1, gpus_per_node=4), cfg)
    assert [g["groupName"] for g in render_manifests(ray)[-1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]] == \
        ["trainers", "rollout"]


def test_the_pods_devices_match_the_configs():
    base = K8sJob(kind="pytorchjob", name="x", image="img:1", nodes=1, gpus_per_node=1, config_yaml="")
    with pytest.raises(K8sError, match="trainer.device=cpu"):
        job_for_config(base, load_config(None, ["trainer.device=cpu"]))
    with pytest.raises(K8sError, match="trainer.device=cuda"):
        job_for_config(replace(base, gpus_per_node=0, cpu_only=True), load_config(None, ["trainer.device=cuda"]))
    assert job_for_config(replace(base, gpus_per_node=0, cpu_only=True), load_config(None, [])).cpu_only


def test_the_configmap_holds_the_resolved_config(tmp_path):
    cfg = load_config(None, ["trainer.total_steps=7", "actor.lr=3e-6"])
    job = job_for_config(K8sJob(kind="indexed-job", name="x", image="img:1", nodes=2, gpus_per_node=1,
                                config_yaml=""), cfg)
    path = tmp_path / "config.yaml"
    path.write_text(render_manifests(job)[0]["data"]["config.yaml"])
    assert config_to_dict(load_config(path)) == config_to_dict(cfg)


# ------------------------------------------------------------------ the CLI, kubectl and files

def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "scalerl", "launch", "k8s", *args], capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, **(env or {})})


def test_cli_print_and_errors(capsys):
    from scalerl.cli import main

    done = _cli("--kind", "trainjob", "--nodes", "2", "--gpus-per-node", "1", "--image", "img:1", "--namespace", "rl",
                "--print", "trainer.total_steps=3")  # overrides may follow the options
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    for doc in docs:
        validate_manifest(doc)
    assert yaml.safe_load(docs[0]["data"]["config.yaml"])["trainer"]["total_steps"] == 3
    assert "not under a --pvc mount" in done.stderr
    for args, message in [
        (["--kind", "pytorchjob", "--nodes", "2", "--gpus-per-node", "0", "--image", "img:1"], "--gpus-per-node 0"),
        (["--kind", "pytorchjob", "--nodes", "2", "--gpus-per-node", "1", "--image", "my image"], "--image 'my image'"),
        (["--kind", "indexed-job", "--nodes", "1", "--gpus-per-node", "1", "--image", "i:1", "--namespace", "Team_A"],
         "--namespace 'Team_A'"),
        (["parallel.dp_replicate=3", "--kind", "rayjob", "--nodes", "2", "--gpus-per-node", "1", "--image", "img:1"],
         "parallel.dp_replicate=3"),
        (["--kind", "rayjob", "--nodes", "2", "--image", "img:1"], "--gpus-per-node G is required"),
        (["--kind", "rayjob", "--nodes", "1", "--cpu-only", "--image", "img:1", "--secret-env", "TOKEN"],
         "--secret-env 'TOKEN': expected NAME=SECRET:KEY"),
    ]:
        assert main(["launch", "k8s", *args, "--print"]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)


def test_output_dir_never_replaces_a_file(tmp_path):
    job = golden_job("indexed-job")
    text = manifests_yaml(render_manifests(job))
    path = write_manifests(text, tmp_path, job.name)
    assert path.read_text() == text
    with pytest.raises(K8sError, match="already exists"):
        write_manifests("other", tmp_path, job.name)
    assert path.read_text() == text


def _fake_kubectl(tmp_path: Path, context_rc: int = 0, create_stderr: str = "") -> dict:
    """A `kubectl` on PATH that records its arguments and stdin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(f"""#!{sys.executable}
import json, sys
log = {str(tmp_path / 'calls.jsonl')!r}
stdin = sys.stdin.read() if sys.argv[1:3] == ["create", "-f"] else ""
with open(log, "a") as f:
    f.write(json.dumps({{"args": sys.argv[1:], "stdin": stdin}}) + "\\n")
if sys.argv[1:3] == ["config", "current-context"]:
    print("kind-test" if {context_rc} == 0 else "", end="")
    sys.stderr.write("" if {context_rc} == 0 else "error: current-context is not set")
    sys.exit({context_rc})
if {create_stderr!r}:
    sys.stderr.write({create_stderr!r})
    sys.exit(1)
print("job.batch/x created")
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_submit_creates_with_kubectl_and_says_how_to_follow(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_kubectl(tmp_path)["PATH"])
    job = golden_job("indexed-job")
    text = manifests_yaml(render_manifests(job))
    out = submit_manifests(text, job)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["args"] for c in calls] == [["config", "current-context"], ["create", "-f", "-"]]
    assert calls[1]["stdin"] == text
    assert "kubectl get job grpo-qwen -n rl -w" in out and "configmap/grpo-qwen-config" in out


def test_submit_errors_without_kubectl_or_context(tmp_path, monkeypatch):
    job = golden_job("pytorchjob")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(K8sError, match="kubectl is not on PATH"):
        submit_manifests("x", job)
    monkeypatch.setenv("PATH", _fake_kubectl(tmp_path, context_rc=1)["PATH"])
    with pytest.raises(K8sError, match="no current context"):
        submit_manifests("x", job)


def test_submit_refuses_to_replace_an_existing_job(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_kubectl(tmp_path, create_stderr='Error from server (AlreadyExists): '
                                                                      'configmaps "grpo-qwen-config" already exists')["PATH"])
    with pytest.raises(K8sError, match="choose another --name"):
        submit_manifests("x", golden_job("pytorchjob"))


def test_cli_submits_through_kubectl(tmp_path):
    env = _fake_kubectl(tmp_path)
    done = _cli("--kind", "pytorchjob", "--nodes", "1", "--gpus-per-node", "1", "--image", "img:1", env=env)
    assert done.returncode == 0, done.stderr
    assert "kubectl get pytorchjob scalerl -n default -w" in done.stdout
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in yaml.safe_load_all(calls[-1]["stdin"])] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]


# ------------------------------------------------------------------ rank detection in an Indexed Job

def test_rank_env_reads_an_indexed_job():
    env = detect_rank_env({"JOB_COMPLETION_INDEX": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "x-0.x",
                           "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 0, 1, 3)
    assert (env.master_addr, env.master_port, env.launcher) == ("x-0.x", 29500, "k8s-indexed-job")
    with pytest.raises(RankEnvError, match="JOB_COMPLETION_INDEX"):
        detect_rank_env({"JOB_COMPLETION_INDEX": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "x-0.x"})
    with pytest.raises(RankEnvError, match="MASTER_ADDR"):
        detect_rank_env({"JOB_COMPLETION_INDEX": "0", "WORLD_SIZE": "2"})
    # torchrun inside a pod (more than one GPU per pod) sets RANK and wins.
    assert detect_rank_env({"JOB_COMPLETION_INDEX": "1", "RANK": "5", "WORLD_SIZE": "8",
                            "LOCAL_WORLD_SIZE": "4"}).launcher == "torchrun"
    # A plain Job's pod without WORLD_SIZE is a single process.
    assert detect_rank_env({"JOB_COMPLETION_INDEX": "0"}) is None


def test_indexed_job_pods_train_as_written(tmp_path):
    """Two local processes get exactly the command and environment the manifest gives its two pods (the
    ConfigMap as the config file, pod 0 reached on loopback) and train together for two steps."""
    overrides = [*TINY, f"trainer.output_dir={tmp_path / 'run'}"]
    job = job_for_config(K8sJob(kind="indexed-job", name="demo", image="img:1", nodes=2, gpus_per_node=0,
                                cpu_only=True, config_yaml=""), load_config(None, overrides))
    docs = render_manifests(job)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(docs[0]["data"]["config.yaml"])
    container = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    command = [sys.executable if w == "python" else str(config_file) if w == "/etc/scalerl/config.yaml" else w
               for w in container["command"]]
    pod_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert pod_env["MASTER_ADDR"] == "demo-0.demo" and pod_env["WORLD_SIZE"] == "2"
    pod_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # pod 0's DNS name, here
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen(command, env={**base, **pod_env, "JOB_COMPLETION_INDEX": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "balance/token_imbalance" in rows[1]  # two data-parallel ranks
