"""The MFU waterfall in the rendered report: a real run of the tiny model (3 steps after a warm-up), its
waterfall computed as the bench computes a cell's (`run_waterfall` over the steps' metrics) and attached to
the recorded report's cells, rendered to PDF and HTML. The PDF must carry the waterfall's page (its title
and slice labels in the page's text, not blank) and its text section; the HTML its figure (an embedded PNG
under the title, decoding to a drawn image) and the same text, also as headless Chromium renders it. A
report without waterfalls renders without them."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import pytest

from scalerl.cli import main
from scalerl.perf.mfu_waterfall import run_waterfall
from scalerl.report.document import WATERFALL_SECTION_TITLE, build_document
from scalerl.report.figures import TITLES
from tests.report.recorded import (
    CHROMIUM,
    FLAGS,
    PNG_MIN_STD,
    png_std,
    recorded_report_path,
)
from tests.tiny import tiny_overrides

needs_poppler = pytest.mark.skipif(
    shutil.which("pdftoppm") is None or shutil.which("pdftotext") is None,
    reason="needs pdftoppm and pdftotext: apt-get install -y --no-install-recommends poppler-utils")


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer
    from scalerl.trainer.run import start_run

    tmp = tmp_path_factory.mktemp("waterfall")
    cfg = load_config(None, tiny_overrides(f"trainer.output_dir={tmp / 'run'}", "trainer.total_steps=4"))
    trainer = RLTrainer(cfg, start_run(cfg, RLTrainer.kind))
    try:
        trainer.advance()
        steps = [trainer.advance() for _ in range(3)]
    finally:
        trainer.close()
    waterfall = run_waterfall(steps).to_json()
    path = recorded_report_path(tmp)
    report = json.loads(path.read_text())
    measured = [c for c in report["cells"] if c.get("status") == "ok" and not c.get("same_as")]
    for cell in measured[:2]:
        cell["mfu_waterfall"] = waterfall
    path.write_text(json.dumps(report))
    return path


def _flat(text: str) -> str:
    return " ".join(text.split())


@needs_poppler
def test_pdf_has_the_waterfall_page_and_its_table(report_path, tmp_path):
    pdf = tmp_path / "report.pdf"
    assert main(["report", str(report_path), "-o", str(pdf)]) == 0
    subprocess.run(["pdftoppm", "-r", "40", "-png", str(pdf), str(tmp_path / "page")], check=True, timeout=120)
    pages = sorted(tmp_path.glob("page-*.png"))
    texts = [_flat(subprocess.run(["pdftotext", "-layout", "-f", str(i), "-l", str(i), str(pdf), "-"],
                                  capture_output=True, text=True, timeout=60, check=True).stdout)
             for i in range(1, len(pages) + 1)]
    (figure_page,) = [i for i, t in enumerate(texts) if TITLES["mfu_waterfall"] in t]
    # horizontal text only (the waterfall's slice names are rotated tick labels): its panel title, the
    # stacked bars' axis and legend
    for label in ("of peak; slices cover", "% of the peak (each bar sums to 100)", "achieved MFU",
                  "compute below peak (kernels, non-matmul work)", "host wait: reward"):
        assert label in texts[figure_page], label
    assert png_std(pages[figure_page]) > PNG_MIN_STD
    table = next(t for t in texts if WATERFALL_SECTION_TITLE in t)
    assert "generation long tail" in table and "slices + achieved =" in table and "MFU pts" in table


def test_html_has_the_waterfall_figure_and_its_table(report_path, tmp_path):
    html = tmp_path / "report.html"
    assert main(["report", str(report_path), "-o", str(html)]) == 0
    text = html.read_text()
    figure = re.search(r"<section id='mfu_waterfall'><h2>([^<]+)</h2><img alt='[^']+' src='data:image/png;base64,"
                       r"([A-Za-z0-9+/=]{2000,})'>", text)
    assert figure is not None and figure.group(1) == TITLES["mfu_waterfall"]
    png = tmp_path / "waterfall.png"
    png.write_bytes(base64.b64decode(figure.group(2)))
    assert png_std(png) > PNG_MIN_STD  # the embedded figure decodes to a drawn image
    section = re.search(r"<section id='mfu_waterfall'><h2>" + re.escape(WATERFALL_SECTION_TITLE) +
                        r"</h2><pre>(.*?)</pre>", text, flags=re.DOTALL)
    assert section is not None
    for label in ("host wait: reward", "weight sync", "imbalance across ranks", "pipeline bubbles",
                  "unattributed (no timer)", "achieved MFU"):
        assert label in section.group(1), label


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y --no-install-recommends chromium")
def test_html_waterfall_renders_in_headless_chromium(report_path, tmp_path):
    html = tmp_path / "report.html"
    assert main(["report", str(report_path), "-o", str(html)]) == 0
    dom = subprocess.run([CHROMIUM, *FLAGS, "--user-data-dir=" + str(tmp_path / "profile"), "--dump-dom",
                          html.as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout
    for title in (TITLES["mfu_waterfall"], WATERFALL_SECTION_TITLE):
        assert f">{title}<" in dom, f"the rendered page has no heading {title!r}"
    assert "compute below peak (kernels, non-matmul work)" in dom


def test_a_report_without_waterfalls_has_neither(tmp_path):
    from scalerl.bench.schema import load_report

    doc = build_document(load_report(recorded_report_path(tmp_path, with_doctor=False)), None)
    assert TITLES["mfu_waterfall"] not in doc.titles() and WATERFALL_SECTION_TITLE not in doc.titles()
