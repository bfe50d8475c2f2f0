"""`scalerl launch slurm|ray|k8s ...`: the launcher subcommands.

`add_launch_parser(subparsers)` registers them on the main CLI's subparsers; every handler imports what
it runs only when invoked, so `scalerl --help` stays fast and Ray is needed only by `launch ray`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SLURM_EPILOG = """\
what it does:
  Writes an sbatch script that starts one `python -m scalerl train` task per GPU (one per node with
  --gpus-per-node 0) through srun, or with --ray one Ray node per Slurm node and a `scalerl launch ray`
  driver on the first. The config and overrides are checked before anything is written or submitted.
  default:   write <trainer.output_dir>/slurm_job.sh, submit it with sbatch, print the job id
  --print:   print the script to stdout; write and submit nothing
  --wait:    after submitting, wait for the job; exit 0 if it COMPLETED, 1 otherwise
  Job logs go to <trainer.output_dir>/logs/<job-name>-<job id>.out/.err unless --output/--error.

examples:
  scalerl launch slurm run.yaml actor.lr=1e-6 --nodes 2 --gpus-per-node 8 --partition gpu --time 04:00:00
  scalerl launch slurm run.yaml --nodes 4 --gpus-per-node 8 --ray --print > job.sh
"""

RAY_EPILOG = """\
what it does:
  Connects to a Ray cluster (--address auto or HOST:PORT, given up after --connect-timeout; none starts a
  local one listening on 127.0.0.1 only; joining a cluster says whether it uses token auth), reserves one
  placement-group bundle per rank (--gpus-per-node GPUs and --cpus-per-rank CPUs each) with the chosen
  strategy, and runs `train(config)` in every rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.
  --max-restarts N: when a rank fails or dies, all ranks are stopped and started again (up to N times),
  continuing from the latest checkpoint in trainer.output_dir (checkpoint with trainer.save_every).

examples:
  scalerl launch ray run.yaml --num-nodes 2 --gpus-per-node 8 --address auto
  scalerl launch ray run.yaml trainer.total_steps=10 --num-nodes 1 --gpus-per-node 0 --cpus-per-rank 1
  scalerl launch ray run.yaml trainer.save_every=50 --num-nodes 2 --gpus-per-node 8 --max-restarts 3
"""


K8S_EPILOG = """\
what it does:
  Checks the config and that --nodes x --gpus-per-node ranks fit its parallel layout, then writes the
  Kubernetes objects: a ConfigMap with the resolved config (mounted at /etc/scalerl), a NetworkPolicy that
  admits only the job's own pods, and the job:
    rayjob       KubeRay RayJob (ray.io/v1, KubeRay >= 1.5): `scalerl launch ray` on a Ray cluster of
                 --nodes worker pods (+ one pod per standalone rollout worker) and a head that runs no rank
    pytorchjob   Kubeflow Training Operator PyTorchJob (kubeflow.org/v1): torchrun in Master + Worker pods
    trainjob     Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1), torch-distributed runtime
    indexed-job  plain Kubernetes: an Indexed Job + headless Service; ranks from JOB_COMPLETION_INDEX
  default:   kubectl create the objects (an existing object of the same name is an error), print how to
             follow the job
  --print:   print the manifests; -o DIR: write DIR/<name>.yaml; neither submits
  Secrets only as references: --secret-env WANDB_API_KEY=wandb:api-key (Secret "wandb", key "api-key").
  Outputs: mount a PersistentVolumeClaim with --pvc CLAIM:/path and set trainer.output_dir under it.

examples:
  scalerl launch k8s run.yaml --kind pytorchjob --nodes 2 --gpus-per-node 8 --image reg.io/me/scalerl:0.1 \\
      --pvc runs:/runs trainer.output_dir=/runs/grpo-1 --secret-env WANDB_API_KEY=wandb:api-key
  scalerl launch k8s run.yaml --kind rayjob --nodes 4 --gpus-per-node 8 --image reg.io/me/scalerl:0.1 --print
"""


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `launch {slurm,ray,k8s}` on the main CLI's subparsers; returns the `launch` parser."""
    formatter = argparse.RawDescriptionHelpFormatter
    launch = subparsers.add_parser("launch", help="start a multi-node job through Slurm, Ray or Kubernetes",
                                   description="start a multi-node job through Slurm, Ray or Kubernetes",
                                   formatter_class=formatter)
    kinds = launch.add_subparsers(dest="launcher", metavar="LAUNCHER", required=True)

    slurm = kinds.add_parser("slurm", help="write (and submit) an sbatch script", epilog=SLURM_EPILOG,
                             description="write and submit an sbatch script for a scalerl training run",
                             formatter_class=formatter)
    _add_config_args(slurm)
    slurm.add_argument("--nodes", type=int, required=True, metavar="N", help="number of nodes")
    slurm.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                       help="GPUs per node (#SBATCH --gres=gpu:G; one task per GPU; default 0 = CPU)")
    slurm.add_argument("--ntasks-per-node", type=int, metavar="T",
                       help="tasks per node (default: --gpus-per-node, or 1 without GPUs)")
    slurm.add_argument("--cpus-per-task", type=int, metavar="C", help="#SBATCH --cpus-per-task")
    slurm.add_argument("--mem", metavar="MEM", help="#SBATCH --mem (e.g. 200G, or 0 for the whole node)")
    slurm.add_argument("--time", default="01:00:00", metavar="T", help="#SBATCH --time (default 01:00:00)")
    slurm.add_argument("--partition", metavar="P", help="#SBATCH --partition")
    slurm.add_argument("--job-name", default="scalerl", metavar="NAME", help="#SBATCH --job-name (default scalerl)")
    slurm.add_argument("--output", metavar="PATH", help="#SBATCH --output (default <output_dir>/logs/%%x-%%j.out)")
    slurm.add_argument("--error", metavar="PATH", help="#SBATCH --error (default <output_dir>/logs/%%x-%%j.err)")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="--OPT=VALUE",
                       help="extra #SBATCH option, e.g. --sbatch-arg=--account=proj (repeatable)")
    slurm.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="export NAME=VALUE in the job before srun (repeatable)")
    slurm.add_argument("--master-addr", metavar="HOST",
                       help="rendezvous address (default: the job's first node, from scontrol)")
    slurm.add_argument("--python", default=sys.executable, metavar="PATH",
                       help=f"python that runs scalerl on the nodes (default {sys.executable})")
    slurm.add_argument("--ray", action="store_true", help="start Ray on the nodes and drive the run through it")
    mode = slurm.add_mutually_exclusive_group()
    mode.add_argument("--print", dest="print_only", action="store_true", help="print the script; do not submit")
    mode.add_argument("--submit", dest="print_only", action="store_false", help="write and submit (the default)")
    slurm.add_argument("--wait", action="store_true", help="wait for the submitted job; exit 0 only if it completed")
    slurm.set_defaults(func=cmd_launch_slurm)

    ray = kinds.add_parser("ray", help="run the ranks as Ray actors (local or an existing cluster)",
                           description="run a scalerl training run as Ray actors", epilog=RAY_EPILOG,
                           formatter_class=formatter)
    _add_config_args(ray)
    ray.add_argument("--num-nodes", type=int, default=1, metavar="N", help="nodes to use (default 1)")
    ray.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                     help="ranks per node = GPUs per node (default 0: CPU, one rank per node)")
    ray.add_argument("--cpus-per-rank", type=float, default=1.0, metavar="C", help="CPUs reserved per rank (default 1)")
    ray.add_argument("--strategy", default="PACK", choices=("PACK", "STRICT_PACK", "SPREAD"),
                     help="placement-group strategy (default PACK)")
    ray.add_argument("--address", metavar="auto|HOST:PORT",
                     help="Ray cluster to join; omit to start a local one")
    ray.add_argument("--dashboard-host", default="127.0.0.1", metavar="HOST",
                     help="dashboard bind address of a locally started Ray (default 127.0.0.1)")
    ray.add_argument("--connect-timeout", type=float, default=30.0, metavar="S",
                     help="give up on an unreachable --address after S seconds (default 30)")
    ray.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="restart the whole job up to N times when a rank fails or dies; each restart "
                          "continues from the latest checkpoint (default 0)")
    ray.set_defaults(func=cmd_launch_ray)
    _add_k8s_parser(kinds, formatter)
    return launch


def _add_k8s_parser(kinds: argparse._SubParsersAction, formatter: type) -> None:
    from scalerl.launch.k8s import K8S_KINDS

    k8s = kinds.add_parser("k8s", help="write (and create) KubeRay / Kubeflow / Job manifests", epilog=K8S_EPILOG,
                           description="run a scalerl training run on Kubernetes", formatter_class=formatter)
    _add_config_args(k8s)
    k8s.add_argument("--kind", required=True, choices=K8S_KINDS, help="what runs the job (see below)")
    k8s.add_argument("--nodes", type=int, required=True, metavar="N", help="pods, one per node")
    k8s.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per pod, one rank each (required unless "
                     "--cpu-only)")
    k8s.add_argument("--cpu-only", action="store_true", help="pods without GPUs, one CPU rank each")
    k8s.add_argument("--image", required=True, metavar="IMAGE", help="container image with scalerl installed")
    k8s.add_argument("--namespace", default="default", metavar="NS")
    k8s.add_argument("--name", default="scalerl", metavar="NAME", help="job name (default scalerl)")
    k8s.add_argument("--cpus-per-node", metavar="Q", help="CPU request/limit per pod (e.g. 32)")
    k8s.add_argument("--memory-per-node", metavar="Q", help="memory request/limit per pod (e.g. 256Gi)")
    k8s.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="plain variable (repeatable)")
    k8s.add_argument("--secret-env", action="append", default=[], metavar="NAME=SECRET:KEY",
                     help="variable from a key of an existing Secret (repeatable)")
    k8s.add_argument("--pvc", action="append", default=[], metavar="CLAIM:PATH",
                     help="mount a PersistentVolumeClaim in every pod (repeatable)")
    k8s.add_argument("--image-pull-secret", metavar="SECRET")
    k8s.add_argument("--service-account", metavar="NAME")
    k8s.add_argument("--active-deadline", type=int, metavar="S", help="stop the job after S seconds")
    k8s.add_argument("--ttl-after-finished", type=int, default=3600, metavar="S",
                     help="delete the finished job's pods after S seconds (default 3600)")
    k8s.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="pod failures retried (the run continues from its latest checkpoint; default 0)")
    k8s.add_argument("--elastic-min-nodes", type=int, metavar="N",
                     help="pytorchjob: elasticPolicy with minReplicas N, maxReplicas --nodes")
    k8s.add_argument("--master-port", type=int, default=29500, metavar="PORT", help="indexed-job rendezvous port")
    k8s.add_argument("--cpus-per-rank", type=float, default=1.0, metavar="C", help="rayjob: CPUs reserved per rank")
    k8s.add_argument("--no-network-policy", action="store_true",
                     help="do not write the NetworkPolicy (ingress only from the job's own pods)")
    mode = k8s.add_mutually_exclusive_group()
    mode.add_argument("--print", dest="print_only", action="store_true", help="print the manifests; submit nothing")
    mode.add_argument("-o", "--output-dir", metavar="DIR", help="write DIR/<name>.yaml; submit nothing")
    k8s.set_defaults(func=cmd_launch_k8s)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config_args", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="optional YAML config file first, then dotted key=value overrides")


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    from scalerl.core.config import ConfigError

    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def cmd_launch_slurm(args: argparse.Namespace) -> int:
    """Check the config, build the job script, then print it or write + submit (+ wait for) it."""
    from scalerl.core.config import ConfigError, load_config, split_config_args
    from scalerl.launch.slurm import SlurmError, slurm_job_script, submit, wait_for_job

    config_path, overrides = split_config_args(args.config_args)
    try:  # validate now: a typo should fail here, not after hours in the queue
        cfg = load_config(config_path, overrides)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    from scalerl.trainer.run_checks import check_run_inputs

    check_run_inputs(cfg, sft=False, import_reward=False)  # the reward may exist only where ranks run
    output_dir = Path(cfg.trainer.output_dir).absolute()
    log_dir = output_dir / "logs"
    try:
        script = slurm_job_script(
            os.path.abspath(config_path) if config_path else None, overrides, nodes=args.nodes,
            gpus_per_node=args.gpus_per_node, ntasks_per_node=args.ntasks_per_node,
            cpus_per_task=args.cpus_per_task, mem=args.mem, time=args.time, partition=args.partition,
            job_name=args.job_name, output=args.output or str(log_dir / "%x-%j.out"),
            error=args.error or str(log_dir / "%x-%j.err"), ray=args.ray, python=args.python,
            extra_sbatch=args.sbatch_arg, env=_env_pairs(args.env), master_addr=args.master_addr)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.print_only:
        print(script, end="")
        return 0
    for path in (args.output, args.error):  # sbatch silently loses logs whose folder is missing
        if path and "%" not in str(Path(path).parent):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    script_path = output_dir / "slurm_job.sh"
    try:
        job_id = submit(script, script_path=script_path)
        print(f"submitted Slurm job {job_id} ({script_path}); logs in {log_dir}", flush=True)
        if not args.wait:
            return 0
        state = wait_for_job(job_id, timeout_s=float("inf"), poll_s=2.0)
    except (SlurmError, FileNotFoundError) as e:  # FileNotFoundError: no sbatch on this machine
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Slurm job {job_id}: {state}")
    return 0 if state == "COMPLETED" else 1


def cmd_launch_ray(args: argparse.Namespace) -> int:
    """Hand the run to `scalerl.launch.ray_launcher.launch_ray` (imported here: Ray is optional)."""
    from scalerl.core.config import ConfigError, split_config_args

    config_path, overrides = split_config_args(args.config_args)
    if (args.num_nodes < 1 or args.gpus_per_node < 0 or not args.cpus_per_rank > 0 or args.max_restarts < 0
            or not args.connect_timeout > 0):
        raise ConfigError("--num-nodes must be >= 1, --gpus-per-node >= 0, --cpus-per-rank > 0, --max-restarts >= 0 "
                          "and --connect-timeout > 0")
    try:
        from scalerl.launch.ray_launcher import launch_ray
    except ModuleNotFoundError as e:
        if e.name in ("ray", "scalerl.launch.ray_launcher"):
            raise ConfigError(f"scalerl launch ray needs Ray (pip install 'scalerl[ray]'): {e}") from None
        raise
    return launch_ray(config_path, overrides, num_nodes=args.num_nodes, gpus_per_node=args.gpus_per_node,
                      cpus_per_rank=args.cpus_per_rank, strategy=args.strategy, address=args.address,
                      dashboard_host=args.dashboard_host, max_restarts=args.max_restarts,
                      connect_timeout_s=args.connect_timeout)


def _split_pairs(pairs: list[str], option: str, sep: str, shape: str) -> list[tuple[str, str]]:
    from scalerl.launch.k8s import K8sError

    out = []
    for pair in pairs:
        left, found, right = pair.partition(sep)
        if not found or not left or not right:
            raise K8sError(f"{option} {pair!r}: expected {shape}")
        out.append((left, right))
    return out


def cmd_launch_k8s(args: argparse.Namespace) -> int:
    """Check the config against the pods, render the manifests, then print, write or create them."""
    from scalerl.core.config import ConfigError, load_config, split_config_args
    from scalerl.launch.k8s import K8sError, K8sJob, manifests_yaml, render_manifests
    from scalerl.launch.k8s_submit import (
        job_for_config,
        submit_manifests,
        write_manifests,
    )
    from scalerl.trainer.run_checks import check_run_inputs

    config_path, overrides = split_config_args(args.config_args)
    try:
        cfg = load_config(config_path, overrides)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    check_run_inputs(cfg, sft=False, import_reward=False)  # the reward module may exist only in the image
    secrets = {}
    for name, ref in _split_pairs(args.secret_env, "--secret-env", "=", "NAME=SECRET:KEY"):
        secret, key = _split_pairs([ref], "--secret-env", ":", "NAME=SECRET:KEY")[0]
        secrets[name] = (secret, key)
    if args.gpus_per_node is None and not args.cpu_only:
        raise K8sError("--gpus-per-node G is required (one rank per GPU), or --cpu-only for pods without GPUs")
    job = K8sJob(kind=args.kind, name=args.name, image=args.image, nodes=args.nodes, cpu_only=args.cpu_only,
                 gpus_per_node=args.gpus_per_node or 0, config_yaml="", namespace=args.namespace,
                 cpus_per_node=args.cpus_per_node, memory_per_node=args.memory_per_node,
                 env=dict(_split_pairs(args.env, "--env", "=", "NAME=VALUE")), secret_env=secrets,
                 volumes=tuple(_split_pairs(args.pvc, "--pvc", ":", "CLAIM:/path")),
                 image_pull_secret=args.image_pull_secret, service_account=args.service_account,
                 active_deadline_s=args.active_deadline, ttl_after_finished_s=args.ttl_after_finished,
                 max_restarts=args.max_restarts, elastic_min_nodes=args.elastic_min_nodes,
                 master_port=args.master_port, cpus_per_rank=args.cpus_per_rank,
                 network_policy=not args.no_network_policy)
    job = job_for_config(job, cfg)
    text = manifests_yaml(render_manifests(job))
    output_dir = Path(cfg.trainer.output_dir)
    if not any(output_dir.is_absolute() and output_dir.is_relative_to(path) for _, path in job.volumes):
        print(f"note: trainer.output_dir={cfg.trainer.output_dir} is not under a --pvc mount, so checkpoints and "
              "metrics stay in the pods and are lost with them", file=sys.stderr)
    if args.print_only:
        print(text, end="")
        return 0
    if args.output_dir:
        print(f"wrote {write_manifests(text, args.output_dir, job.name)}")
        return 0
    print(submit_manifests(text, job), end="")
    return 0
