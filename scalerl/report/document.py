"""What the report says, in order, independent of the output format: the first page (headlines and the
recommended configuration), the figures, the measured and projected tables, the doctor tree, and an
appendix (environment, cells that failed or were skipped). `pdf` and `html` lay it out."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from matplotlib.figure import Figure

from scalerl.bench.tables import measured_tables, projected_tables
from scalerl.report.figures import TITLES, all_figures, waterfall_text
from scalerl.report.findings import headlines, recommend

FIRST_PAGE_TITLE = "scalerl performance analysis"
SECTION_TITLES = {
    "measured": "Measured tables",
    "projected": "Projected tables (cost model)",
    "doctor": "scalerl doctor tree",
    "appendix": "Appendix: environment and cells",
}
# Only in reports whose cells carry a waterfall (bench reports written since it was added).
WATERFALL_SECTION_TITLE = "MFU waterfall per cell (measured, seconds per step)"


@dataclass
class TextSection:
    key: str
    title: str
    text: str  # preformatted (monospace)


@dataclass
class Document:
    title: str
    subtitle: str
    headlines: list[str]
    recommendation: dict[str, Any]
    target: str
    figures: list[tuple[str, Figure]] = field(default_factory=list)
    sections: list[TextSection] = field(default_factory=list)

    def titles(self) -> list[str]:
        """Every page / section title, in order (what the rendered output must show)."""
        return [self.title] + [TITLES[k] for k, _ in self.figures] + [s.title for s in self.sections]


def _doctor_text(doctor: dict[str, Any]) -> str:
    from rich.console import Console

    from scalerl.doctor.render import build_tree
    from scalerl.doctor.report import DoctorReport

    console = Console(file=io.StringIO(), width=110, color_system=None, record=True)
    console.print(build_tree(DoctorReport.from_json(doctor)))
    return console.export_text()


def _appendix(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"command: {report.get('command')}", f"created: {report.get('created')}"]
    lines += [f"{k}: {env.get(k)}" for k in ("scalerl", "git_commit", "git_dirty", "python", "torch", "transformers",
                                            "platform", "hostname", "cpu_model", "cores", "memory_gb", "gpus",
                                            "load_average_before", "load_average_after")]
    lines.append("")
    for cell in report["cells"]:
        if cell.get("exit_warning"):
            lines.append(f"measured, then a rank failed on exit: {cell['id']}: {cell['exit_warning'].splitlines()[0]}")
        if cell.get("status") != "ok":
            reason = cell.get("reason", "").splitlines()[0] if cell.get("reason") else ""
            lines.append(f"{cell['status']}: {cell['id']}: {reason}")
    return "\n".join(lines)


def build_document(report: dict[str, Any], projection: dict[str, Any] | None) -> Document:
    env = report["environment"]
    subtitle = (f"{len([c for c in report['cells'] if c.get('status') == 'ok'])} measured cells on "
                f"{env.get('hostname')} ({env.get('cores')} cores), commit {(env.get('git_commit') or '?')[:10]}, "
                f"{report.get('created')}")
    target = "no target cluster projected"
    if projection:
        target = (f"target: {max((r['nodes'] for r in projection['rows']), default=0)} nodes x "
                  f"{projection['devices_per_node']} device(s), model {projection['model']}, device "
                  f"{projection['device']}, inter-node link: {projection['calibration']['inter_link']}")
    doc = Document(FIRST_PAGE_TITLE, subtitle, headlines(report), recommend(report, projection), target,
                   all_figures(report, projection))
    doc.sections.append(TextSection("measured", SECTION_TITLES["measured"], measured_tables(report)))
    if projection:
        doc.sections.append(TextSection("projected", SECTION_TITLES["projected"], projected_tables(projection)))
    waterfalls = waterfall_text(report)
    if waterfalls:
        doc.sections.append(TextSection("mfu_waterfall", WATERFALL_SECTION_TITLE, waterfalls))
    if report.get("doctor"):
        doc.sections.append(TextSection("doctor", SECTION_TITLES["doctor"], _doctor_text(report["doctor"])))
    doc.sections.append(TextSection("appendix", SECTION_TITLES["appendix"], _appendix(report)))
    return doc
