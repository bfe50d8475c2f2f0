"""`scalerl doctor`: argument parsing and output (the tree on stdout, `--json PATH`), on every rank of any
launcher, or on Ray rank actors with `--ray`. `scripts/diagnose.py` is the same command."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from scalerl.core.config import ConfigError, split_config_args

EPILOG = """\
modes (both may be given; neither = --distributed-check):
  --distributed-check        every rank's facts and their consistency, a rank that never joins named,
                             all-reduce sweeps (intra- and inter-node) and node-pair links, shared paths
  --performance-profiling    N steps of a real config (CONFIG.yaml and key=value overrides), per rank and
                             phase, with the findings on the tree

every finding lands on a leaf of the tree (communication | compute load | resources | training signal) as
ok / warning / fault / not measured, with the evidence and a fix. Exit code 1 when a fault would stop or
cripple training, 2 for bad arguments. The JSON report (--json) is documented in docs/doctor.md.

examples:
  scalerl doctor --distributed-check --json doctor.json
  torchrun --nproc-per-node 8 -m scalerl doctor --distributed-check
  scalerl doctor --performance-profiling run.yaml parallel.tp=2 --steps 5 --trace traces/
  scalerl doctor --distributed-check --ray --num-nodes 2 --gpus-per-node 8 --address auto
  python scripts/diagnose.py --distributed-check
"""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"64MiB", "1G", "4096" -> bytes (K/M/G are binary multiples)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1MiB, 256MiB, 1GiB)")
    unit = (match.group(2) or "B").upper()[0]
    return int(float(match.group(1)) * {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit])


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("%(prog)s [--distributed-check] [--performance-profiling [CONFIG.yaml]] [key=value ...] "
                    "[options]")
    parser.add_argument("config_args", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="config for the run's paths and for --performance-profiling")
    parser.add_argument("--distributed-check", action="store_true", help="check the world: facts, links, paths")
    parser.add_argument("--performance-profiling", nargs="?", const="", default=None, metavar="CONFIG",
                        help="profile N steps of CONFIG (default: the built-in defaults)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON (schema scalerl.doctor/1)")
    parser.add_argument("--list-rules", action="store_true", help="print every rule, threshold and reason")
    check = parser.add_argument_group("distributed check")
    check.add_argument("--min-size", type=parse_size, default=2**20, metavar="SIZE", help="smallest all-reduce (1MiB)")
    check.add_argument("--max-size", type=parse_size, default=None, metavar="SIZE",
                       help="largest all-reduce (default 256MiB on GPUs, 16MiB on CPUs)")
    check.add_argument("--iters", type=int, default=5, metavar="N", help="timed all-reduces per size (5)")
    check.add_argument("--join-timeout", type=float, default=60.0, metavar="S",
                       help="seconds rank 0 waits for every rank to join before naming the missing (60)")
    check.add_argument("--timeout", type=float, default=300.0, metavar="S", help="limit of any collective (300)")
    check.add_argument("--path", action="append", default=[], metavar="DIR",
                       help="another path to check for space and sharing (repeatable)")
    profile = parser.add_argument_group("performance profiling")
    profile.add_argument("--kind", choices=("rl", "sft"), default="rl", help="trainer to profile (rl)")
    profile.add_argument("--steps", type=int, default=3, metavar="N", help="profiled steps (3)")
    profile.add_argument("--warmup", type=int, default=1, metavar="N", help="steps run first, not profiled (1)")
    profile.add_argument("--trace", metavar="DIR", help="write a torch.profiler Chrome trace per rank to DIR")
    profile.add_argument("--scratch-dir", default="outputs/doctor", metavar="DIR",
                         help="where the profiled run writes (never the config's own output_dir)")
    profile.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    profile.add_argument("--plan", metavar="PLAN.json",
                         help="print planned vs measured per phase, from `scalerl plan CONFIG --json PLAN.json`")
    ray = parser.add_argument_group("Ray (run the ranks as Ray actors, like `scalerl launch ray`)")
    ray.add_argument("--ray", action="store_true", help="start one rank actor per GPU (or per node on CPU)")
    ray.add_argument("--num-nodes", type=int, default=1, metavar="N")
    ray.add_argument("--gpus-per-node", type=int, default=0, metavar="G")
    ray.add_argument("--cpus-per-rank", type=float, default=1.0, metavar="C")
    ray.add_argument("--strategy", default="PACK", choices=("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"))
    ray.add_argument("--address", default=None, help="Ray cluster address (auto, host:port); default: start one")


def options_from_args(args: argparse.Namespace) -> Any:
    from scalerl.doctor.diagnose import DoctorOptions

    config_args = list(args.config_args)
    if args.performance_profiling:  # `--performance-profiling run.yaml` (or an override that landed there)
        config_args.insert(0, args.performance_profiling)
    path, overrides = split_config_args(config_args)
    for name in ("steps", "iters"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.join_timeout <= 0 or args.timeout <= 0:
        raise ConfigError("--warmup must be >= 0 and --join-timeout / --timeout > 0")
    if args.max_size is not None and args.max_size < args.min_size:
        raise ConfigError(f"--max-size ({args.max_size} B) is below --min-size ({args.min_size} B)")
    profile = args.performance_profiling is not None
    if args.plan:
        if not profile:
            raise ConfigError("--plan compares a plan with a profile: add --performance-profiling CONFIG")
        from scalerl.doctor.plan_comparison import read_plan

        read_plan(args.plan)  # a bad file is said now, not after the profile ran
    return DoctorOptions(
        distributed_check=args.distributed_check or not profile, profile=profile, config_path=path,
        overrides=overrides, kind=args.kind, steps=args.steps, warmup=args.warmup, trace_dir=args.trace,
        min_size=args.min_size, max_size=args.max_size, iters=args.iters, join_timeout_s=args.join_timeout,
        timeout_s=args.timeout, paths=args.path, scratch_dir=args.scratch_dir, device=args.device,
        plan_path=args.plan)


def run_doctor(args: argparse.Namespace) -> int:
    if args.list_rules:
        from scalerl.health.thresholds import describe_rules

        print(describe_rules())
        return 0
    options = options_from_args(args)

    def publish(report: Any) -> None:
        from scalerl.doctor.render import render

        render(report)
        if args.json:
            path = args.json
            if "why" in report.world and report.facts and report.facts[0]["rank"] != 0:  # alone: one file per rank
                stem, dot, suffix = path.rpartition(".")
                path = f"{stem}.rank{report.facts[0]['rank']}.{suffix}" if dot else f"{path}.rank{report.facts[0]['rank']}"
            print(f"report written to {report.write(path)}")
        sys.stdout.flush()

    if args.ray:
        from scalerl.doctor.ray_doctor import diagnose_on_ray

        report = diagnose_on_ray(options, args.num_nodes, args.gpus_per_node, args.cpus_per_rank, args.strategy,
                                 args.address)
        publish(report)
        return report.exit_code
    from scalerl.doctor.diagnose import diagnose

    code, _ = diagnose(options, on_report=publish)
    return code
