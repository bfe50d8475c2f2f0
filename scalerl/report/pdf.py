"""The report as a PDF (matplotlib's PdfPages): the first page, one page per figure, the tables and the
doctor tree as monospace text pages (split over as many pages as they need)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.backends.backend_pdf import PdfPages

from scalerl.report.document import Document
from scalerl.report.figures import PAGE

LINES_PER_PAGE = 58
TEXT_WIDTH = 150  # characters of a monospace line at the text pages' size


def _first_page(doc: Document):
    fig = plt.figure(figsize=PAGE)
    fig.text(0.05, 0.94, doc.title, fontsize=22, fontweight="bold")
    fig.text(0.05, 0.905, doc.subtitle, fontsize=9, color="dimgray")
    y = 0.86
    fig.text(0.05, y, "Headline findings (measured)", fontsize=13, fontweight="bold")
    y -= 0.035
    for line in doc.headlines:
        for i, part in enumerate(textwrap.wrap(line, 135)):
            fig.text(0.06, y, ("- " if i == 0 else "  ") + part, fontsize=9)
            y -= 0.026
    y -= 0.02
    rec = doc.recommendation
    fig.text(0.05, y, "Recommended configuration", fontsize=13, fontweight="bold")
    y -= 0.03
    fig.text(0.06, y, doc.target, fontsize=8, color="dimgray")
    y -= 0.03
    settings = f"strategy: {rec.get('strategy') or '-'}   gradient compression: {rec['compression']}   " \
               f"weight sync: {rec['weight_sync']}"
    fig.text(0.06, y, settings, fontsize=11, family="monospace")
    y -= 0.035
    for line in rec["reasoning"]:
        for i, part in enumerate(textwrap.wrap(line, 135)):
            fig.text(0.06, y, ("- " if i == 0 else "  ") + part, fontsize=9)
            y -= 0.026
    return fig


def _text_pages(title: str, text: str):
    lines = []
    for raw in text.splitlines() or [""]:
        lines += textwrap.wrap(raw, TEXT_WIDTH, subsequent_indent="    ", drop_whitespace=False) or [""]
    pages = [lines[i:i + LINES_PER_PAGE] for i in range(0, len(lines), LINES_PER_PAGE)] or [[]]
    for n, chunk in enumerate(pages):
        fig = plt.figure(figsize=PAGE)
        fig.text(0.04, 0.95, title + (f" ({n + 1}/{len(pages)})" if len(pages) > 1 else ""), fontsize=15,
                 fontweight="bold")
        fig.text(0.04, 0.92, "\n".join(chunk), fontsize=6.2, family="monospace", va="top")
        yield fig


def write_pdf(doc: Document, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with PdfPages(tmp) as pdf:
        first = _first_page(doc)
        pdf.savefig(first)
        plt.close(first)
        for _, fig in doc.figures:
            pdf.savefig(fig)
            plt.close(fig)
        for section in doc.sections:
            for fig in _text_pages(section.title, section.text):
                pdf.savefig(fig)
                plt.close(fig)
        info = pdf.infodict()
        info["Title"] = doc.title
        info["Creator"] = "scalerl report"
    tmp.replace(path)
    return path
