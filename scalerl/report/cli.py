"""`scalerl report REPORT.json -o performance_analysis.pdf|.html`: the benchmark report rendered for people,
with a projection to the target cluster (``--nodes``, ``--devices-per-node``, ``--link``, ...) that the
recommended configuration is made for."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scalerl.core.config import ConfigError

EPILOG = """\
The output format follows the extension: .pdf (matplotlib, one page per figure) or .html (one self-contained
file: figures embedded, no network fetches). The first page holds the headline findings and the recommended
configuration for the target cluster, projected by the cost model calibrated on the report.

examples:
  scalerl report benchmark_report.json -o performance_analysis.pdf
  scalerl report benchmark_report.json -o performance_analysis.html
  scalerl report benchmark_report.json -o cluster.pdf --nodes 1,2,4,8,16 --devices-per-node 8 \\
                 --link ib-hdr --intra-link nvlink4 --model qwen2.5-7b --device h100 --mfu-train 0.4 --mfu-gen 0.1
  python scripts/performance_analyzer.py --input benchmark_report.json --output performance_analysis.pdf
"""


def _csv(kind=str):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="REPORT.json", help="benchmark_report.json from scalerl bench")
    parser.add_argument("-o", "--output", default="performance_analysis.pdf", metavar="PATH",
                        help="output file, .pdf or .html (default performance_analysis.pdf)")
    target = parser.add_argument_group("target cluster (for the projection and the recommendation)")
    target.add_argument("--nodes", type=_csv(int), metavar="LIST", help="node counts (default 1,2,4,8)")
    target.add_argument("--devices-per-node", type=int, metavar="G", help="default: the report's ranks per node")
    target.add_argument("--strategies", type=_csv(), metavar="LIST", help="default: the report's strategies")
    target.add_argument("--link", default="measured", metavar="NAME")
    target.add_argument("--intra-link", default="measured", metavar="NAME")
    target.add_argument("--model", default="measured", metavar="NAME")
    target.add_argument("--device", default="measured", metavar="NAME")
    target.add_argument("--mfu-train", type=float, metavar="F")
    target.add_argument("--mfu-gen", type=float, metavar="F")


def run_report_command(args: argparse.Namespace) -> int:
    from scalerl.bench.projection import ProjectionTarget, project
    from scalerl.bench.schema import load_report
    from scalerl.report.document import build_document

    output = Path(args.output)
    if output.suffix.lower() not in (".pdf", ".html", ".htm"):
        raise ConfigError(f"-o {output}: the extension chooses the format, .pdf or .html")
    report = load_report(args.report)
    measured = [c for c in report["cells"] if c.get("status") == "ok" and not c.get("calibration")]
    strategies = args.strategies or list(dict.fromkeys(c["strategy"] for c in measured)) or ["ddp", "fsdp", "hsdp"]
    target = ProjectionTarget(
        nodes=args.nodes or [1, 2, 4, 8],
        devices_per_node=args.devices_per_node or report["config"].get("ranks_per_node", 1),
        strategies=strategies, model=args.model, link=args.link, intra_link=args.intra_link, device=args.device,
        mfu_train=args.mfu_train, mfu_gen=args.mfu_gen)
    projection = None
    try:
        projection = project(report, target)
    except (KeyError, ValueError) as e:
        print(f"warning: no projection ({e.args[0] if e.args else e}); the report shows measurements only",
              file=sys.stderr)
    doc = build_document(report, projection)
    if output.suffix.lower() == ".pdf":
        from scalerl.report.pdf import write_pdf

        write_pdf(doc, output)
    else:
        from scalerl.report.html import write_html

        write_html(doc, output)
    print(f"wrote {output} ({len(doc.titles())} sections: {', '.join(doc.titles())})")
    return 0
