#!/usr/bin/env python3
"""The seed article's benchmark command, as written, a thin wrapper over `scalerl bench`:

    python tests/utils/profiler/test_performance_benchmark.py --num_nodes 4 --iterations 100 \
        --output_report benchmark_report.json

``--num_nodes N`` measures 1, 2, 4, ... up to N nodes; above one node they are emulated on this machine
(network namespaces joined by links shaped at ``--rate_mbit``, 1000 by default), which needs root and
iproute2: without them the command stops with an error that says so. ``--iterations`` is the measured steps
per cell (after ``--warmup``). Any other option goes to `scalerl bench` unchanged (`scalerl bench --help`).

This is a script, not a test module: it defines no test functions, runs only under ``__main__``, and
tests/utils/profiler/conftest.py keeps pytest from collecting it (its name is the seed's). Its translation
of the options is tested in tests/bench/test_seed_wrappers.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_STRATEGIES = "ddp,fsdp,pp"


def node_counts(num_nodes: int) -> list[int]:
    """1, 2, 4, ... below ``num_nodes``, then ``num_nodes`` itself."""
    counts, n = [], 1
    while n < num_nodes:
        counts.append(n)
        n *= 2
    return counts + [num_nodes]


def build_argv(argv: list[str]) -> list[str]:
    """The `scalerl` command line this wrapper runs for ``argv``."""
    parser = argparse.ArgumentParser(prog="test_performance_benchmark.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_nodes", type=int, default=1, help="largest node count (emulated above 1)")
    parser.add_argument("--iterations", type=int, default=20, help="measured steps per cell")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first, not measured")
    parser.add_argument("--output_report", default="benchmark_report.json", help="where the JSON report goes")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated (scalerl bench)")
    parser.add_argument("--rate_mbit", default="1000", help="inter-node link rate(s), comma-separated")
    args, rest = parser.parse_known_args(argv)
    if args.num_nodes < 1 or args.iterations < 1:
        parser.error("--num_nodes and --iterations must be >= 1")
    return ["bench", "--nodes", ",".join(map(str, node_counts(args.num_nodes))), "--steps", str(args.iterations),
            "--warmup", str(args.warmup), "--strategies", args.strategies, "--rate-mbit", args.rate_mbit,
            "-o", args.output_report, *rest]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run from a checkout without installing
    from scalerl.cli import main as scalerl_main

    return scalerl_main(build_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
