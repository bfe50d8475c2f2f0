"""`scalerl bench` arguments: measure a matrix (default), ``--compare A.json B.json``, or ``--project``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from scalerl.bench.matrix import STRATEGY_HELP, WEIGHT_SYNC_MODES, BenchMatrix
from scalerl.core.config import ConfigError

EPILOG = f"""\
strategies (join with +, e.g. tp2+ddp, pp2+fsdp):
{chr(10).join(f'  {k:6} {v}' for k, v in STRATEGY_HELP.items())}
nodes above 1 are emulated on this machine (network namespaces, links shaped with tc): root and iproute2.

examples:
  scalerl bench                                           # ddp, fsdp on 1 and 2 nodes, 20 steps each
  scalerl bench --strategies ddp,fsdp,hsdp,tp2+ddp --nodes 1,2,4 --ranks-per-node 2 --rate-mbit 200
  scalerl bench --matrix examples/bench/validation.yaml -o validation.json
  scalerl bench --compression none,fp16 --allreduce flat,hierarchical   # comm.* keys, as plain overrides
  scalerl bench --weight-sync full,delta                  # standalone rollout workers on a node of their own
  scalerl bench --compare before.json after.json
  scalerl bench --project --nodes 1,2,4,8                 # from ./benchmark_report.json (made if missing)
  scalerl bench --project --nodes 1,2,4,8 --devices-per-node 8 --model qwen2.5-7b --link ib-hdr \\
                --intra-link nvlink4 --device h100 --mfu-train 0.4 --mfu-gen 0.1
links: measured (the report's emulated links), doctor (a --doctor report's sweep), or a nominal preset;
models for --project: measured, or a Qwen2.5 size; `scalerl bench --list` names them all.
"""


def _csv(kind=str):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {kind.__name__}: {text!r}") from None
    return parse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_argument_group("modes (default: measure the matrix)")
    mode.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="change per cell, with a noise band")
    mode.add_argument("--project", action="store_true", help="projected tables from a report's calibration")
    mode.add_argument("--list", action="store_true", help="link presets, models and devices --project knows")
    m = parser.add_argument_group("matrix")
    m.add_argument("--matrix", metavar="YAML", help="matrix file (keys as below); flags given override it")
    m.add_argument("--strategies", type=_csv(), metavar="LIST")
    m.add_argument("--nodes", type=_csv(int), metavar="LIST", help="node counts (emulated above 1)")
    m.add_argument("--ranks-per-node", type=int, metavar="N")
    m.add_argument("--rate-mbit", type=_csv(float), metavar="LIST", help="inter-node link rates (default 1000)")
    m.add_argument("--compression", type=_csv(), metavar="LIST", help="comm.gradient_compression values (none)")
    m.add_argument("--allreduce", type=_csv(), metavar="LIST", help="comm.allreduce values (default: unset)")
    m.add_argument("--weight-sync", type=_csv(), metavar="LIST", help=f"{' | '.join(WEIGHT_SYNC_MODES)}")
    m.add_argument("--steps", type=int, metavar="N", help="measured steps per cell (20)")
    m.add_argument("--warmup", type=int, metavar="N", help="steps run first, not measured (3)")
    m.add_argument("--model", metavar="builtin|DIR|NAME", help="bench: builtin or a model directory; "
                   "--project: measured or a Qwen2.5 size")
    m.add_argument("--prompts-per-rank", type=int, metavar="N", help="prompts per data-parallel rank (4)")
    m.add_argument("--threads-per-rank", type=int, metavar="N", help="torch threads per rank (1)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every cell")
    m.add_argument("--no-baselines", action="store_true", help="skip the plain PyTorch and HF generate baselines")
    m.add_argument("--doctor", metavar="JSON", help="a scalerl doctor report to embed (and calibrate links from)")
    m.add_argument("-o", "--output", default="benchmark_report.json", metavar="PATH")
    m.add_argument("--cell-timeout", type=float, metavar="S", help="limit per cell (default 120 + 20 s per step)")
    m.add_argument("--work-dir", metavar="DIR", help="keep the cells' scratch files here")
    p = parser.add_argument_group("projection")
    p.add_argument("--report", default="benchmark_report.json", metavar="JSON", help="calibration for --project")
    p.add_argument("--devices-per-node", type=int, default=1, metavar="G")
    p.add_argument("--link", default="measured", metavar="NAME")
    p.add_argument("--intra-link", default="measured", metavar="NAME")
    p.add_argument("--device", default="measured", metavar="NAME", help="measured, or a GPU (h100, a100, h200)")
    p.add_argument("--mfu-train", type=float, metavar="F")
    p.add_argument("--mfu-gen", type=float, metavar="F")
    p.add_argument("--rows-per-rank", type=int, metavar="N")
    p.add_argument("--prompt-len", type=float, metavar="T")
    p.add_argument("--response-len", type=float, metavar="T")
    p.add_argument("--json", metavar="PATH", help="also write the projection as JSON")
    parser.add_argument("--min-band", type=float, default=0.03, metavar="F", help="--compare: smallest noise band")


def matrix_from_args(args: argparse.Namespace) -> BenchMatrix:
    data: dict[str, Any] = {}
    if args.matrix:
        try:
            data = yaml.safe_load(Path(args.matrix).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"--matrix {args.matrix}: no such file") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--matrix {args.matrix}: expected a mapping of matrix keys")
    flags = {"strategies": args.strategies, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
             "rates_mbit": args.rate_mbit, "compression": args.compression, "allreduce": args.allreduce,
             "weight_sync": args.weight_sync, "steps": args.steps, "warmup": args.warmup, "model": args.model,
             "prompts_per_rank": args.prompts_per_rank, "threads_per_rank": args.threads_per_rank,
             "baselines": False if args.no_baselines else None}
    data.update({k: v for k, v in flags.items() if v is not None})
    data["overrides"] = list(data.get("overrides", [])) + list(args.set)
    try:
        matrix = BenchMatrix.from_dict(data)
        matrix.check()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bench matrix: {e}") from None
    if matrix.model != "builtin" and not Path(matrix.model).is_dir():
        raise ConfigError(f"--model {matrix.model!r}: not 'builtin' and not a model directory")
    return matrix


def run_bench_command(args: argparse.Namespace) -> int:
    from scalerl.bench.schema import load_report

    if args.compare:
        from scalerl.bench.compare import compare_reports, format_comparison

        a, b = (load_report(p) for p in args.compare)
        rows = compare_reports(a, b, args.min_band)
        print(format_comparison(rows, *args.compare, a, b))
        return 0
    if args.project:
        return _project(args)
    if args.list:
        return _list()
    from scalerl.bench.run import run_bench
    from scalerl.bench.tables import measured_tables

    matrix = matrix_from_args(args)
    doctor = json.loads(Path(args.doctor).read_text()) if args.doctor else None
    command = "scalerl bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["bench"] \
        else " ".join(shlex.quote(a) for a in sys.argv)
    report = run_bench(matrix, args.output, command=command, doctor=doctor, cell_timeout_s=args.cell_timeout,
                       work_dir=args.work_dir)
    print(measured_tables(report))
    failed = [c for c in report["cells"] if c["status"] == "failed"]
    for cell in failed:
        print(f"\nFAILED {cell['id']}: {cell['reason']}", file=sys.stderr)
    for cell in report["cells"]:
        if cell.get("exit_warning"):
            print(f"\nwarning: {cell['id']} measured, then a rank failed on exit: {cell['exit_warning']}",
                  file=sys.stderr)
    print(f"\nreport written to {args.output} (scalerl report {args.output} -o performance_analysis.pdf)")
    return 1 if failed else 0


def _list() -> int:
    from scalerl.bench.cost_model.collective_cost import LINK_PRESETS
    from scalerl.bench.cost_model.model_shapes import QWEN25_SHAPES
    from scalerl.bench.projection import DEVICE_MEMORY_GB

    print("links (--link / --intra-link): measured, doctor (inter-node only)")
    for name, link in LINK_PRESETS.items():
        print(f"  {name:8} {link.source}")
    print("models (--model with --project): measured, " + ", ".join(QWEN25_SHAPES))
    print("devices (--device): measured, " + ", ".join(DEVICE_MEMORY_GB))
    return 0


def _project(args: argparse.Namespace) -> int:
    from scalerl.bench.cost_model.collective_cost import LINK_PRESETS
    from scalerl.bench.projection import ProjectionTarget, project
    from scalerl.bench.schema import load_report
    from scalerl.bench.tables import projected_tables

    path = Path(args.report)
    if not path.exists():
        from scalerl.bench.run import run_bench

        print(f"{path} does not exist: measuring the calibration cell first (one rank, 10 steps)", file=sys.stderr)
        run_bench(BenchMatrix(strategies=[], nodes=[1], steps=10, warmup=2, overrides=list(args.set)), path,
                  command="scalerl bench --project (calibration)")
    report = load_report(path)
    target = ProjectionTarget(
        nodes=args.nodes or [1, 2, 4, 8], devices_per_node=args.devices_per_node,
        strategies=args.strategies or ["ddp", "fsdp", "hsdp"], model=args.model or "measured", link=args.link,
        intra_link=args.intra_link, device=args.device, mfu_train=args.mfu_train, mfu_gen=args.mfu_gen,
        rows_per_rank=args.rows_per_rank, prompt_len=args.prompt_len, response_len=args.response_len)
    for name, value in (("--link", target.link), ("--intra-link", target.intra_link)):
        if value not in ("measured", "doctor", *LINK_PRESETS) or (name == "--intra-link" and value == "doctor"):
            raise ConfigError(f"{name} {value!r}: choose measured, {'doctor, ' if name == '--link' else ''}"
                              f"or one of {', '.join(LINK_PRESETS)}")
    try:
        result = project(report, target)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"--project: {e.args[0] if e.args else e}") from None
    print(projected_tables(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0
