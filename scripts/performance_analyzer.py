#!/usr/bin/env python3
"""The seed article's analysis script, as written, a thin wrapper over `scalerl report`:

    python scripts/performance_analyzer.py --input benchmark_report.json --output performance_analysis.pdf

``--output`` ending in .html writes the self-contained HTML report instead. Other options (the target
cluster: --nodes, --devices-per-node, --link, --model, --device, ...) go to `scalerl report` unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_argv(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(prog="performance_analyzer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default="benchmark_report.json", help="benchmark_report.json (scalerl bench)")
    parser.add_argument("--output", default="performance_analysis.pdf", help=".pdf or .html")
    args, rest = parser.parse_known_args(argv)
    return ["report", args.input, "-o", args.output, *rest]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from scalerl.cli import main as scalerl_main

    return scalerl_main(build_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
