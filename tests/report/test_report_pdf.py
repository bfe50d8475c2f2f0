"""The PDF report from a recorded benchmark report (with a doctor report embedded), rendered page by page to
PNG with poppler's pdftoppm: every page exists, is not blank, and carries its title (pdftotext).
Skips, with the install command, where poppler-utils is missing."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from scalerl.cli import main
from scalerl.report.document import FIRST_PAGE_TITLE, SECTION_TITLES, build_document
from scalerl.report.figures import TITLES
from tests.report.recorded import PNG_MIN_STD, png_std, recorded_report_path

pytestmark = pytest.mark.skipif(
    shutil.which("pdftoppm") is None or shutil.which("pdftotext") is None,
    reason="needs pdftoppm and pdftotext: apt-get install -y --no-install-recommends poppler-utils")


def _page_text(pdf, page: int) -> str:
    done = subprocess.run(["pdftotext", "-layout", "-f", str(page), "-l", str(page), str(pdf), "-"],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_pdf_pages_exist_are_not_blank_and_carry_their_titles(tmp_path):
    report_path = recorded_report_path(tmp_path)
    pdf = tmp_path / "performance_analysis.pdf"
    assert main(["report", str(report_path), "-o", str(pdf)]) == 0
    subprocess.run(["pdftoppm", "-r", "40", "-png", str(pdf), str(tmp_path / "page")], check=True, timeout=120)
    pages = sorted(tmp_path.glob("page-*.png"))
    texts = [_page_text(pdf, i + 1) for i in range(len(pages))]
    assert len(pages) >= 12, f"only {len(pages)} pages"
    for page in pages:
        assert png_std(page) > PNG_MIN_STD, f"{page.name} is blank"
    expected = [FIRST_PAGE_TITLE, "Headline findings (measured)", "Recommended configuration"] + \
        [TITLES[k] for k in ("throughput", "efficiency", "latency", "bytes", "memory", "baselines", "validation",
                             "projection")] + list(SECTION_TITLES.values())
    flat = [" ".join(t.split()) for t in texts]
    for title in expected:
        assert any(title in t for t in flat), f"no page carries {title!r}"
    assert FIRST_PAGE_TITLE in flat[0] and "strategy:" in flat[0] and "weight sync:" in flat[0]
    assert TITLES["throughput"] in flat[1]  # figures follow the first page in order
    doctor_page = next(t for t in flat if SECTION_TITLES["doctor"] in t)
    assert "communication" in doctor_page and "library version mismatch" in doctor_page


def test_document_titles_follow_the_report(tmp_path):
    from scalerl.bench.schema import load_report

    report = load_report(recorded_report_path(tmp_path, with_doctor=False))
    report["validation"] = []
    report["baselines"] = {}
    doc = build_document(report, None)
    titles = doc.titles()
    assert TITLES["validation"] not in titles and TITLES["baselines"] not in titles
    assert TITLES["projection"] not in titles and SECTION_TITLES["doctor"] not in titles
    assert doc.recommendation["strategy"] is None and "No projection" in doc.recommendation["reasoning"][0]
    # the recorded report measured delta against full pushes: the recommendation follows the measurement
    assert doc.recommendation["weight_sync"] in ("delta", "full")
    # with only colocated cells nothing was measured over the network: auto, said why
    report["cells"] = [c for c in report["cells"] if c.get("weight_sync") == "colocated"]
    doc = build_document(report, None)
    assert doc.recommendation["weight_sync"] == "auto"
    assert any("weight_sync.mode=auto" in r for r in doc.recommendation["reasoning"])


def test_doctor_sweep_calibrates_the_inter_node_link(tmp_path):
    """`--link doctor`: the inter-node link fitted to the embedded doctor report's sweep (recorded: busbw
    1.06 GB/s between 2 nodes), used by the projection and named in its calibration."""
    from scalerl.bench.projection import ProjectionTarget, project
    from scalerl.bench.schema import load_report

    report = load_report(recorded_report_path(tmp_path))
    result = project(report, ProjectionTarget(nodes=[1, 2], strategies=["ddp"], link="doctor"))
    assert "scalerl doctor inter-node sweep" in result["calibration"]["inter_link"]
    from scalerl.bench.calibration import doctor_link

    assert doctor_link(report["doctor"]).bytes_per_s == pytest.approx(1.0625e9, rel=0.01)
