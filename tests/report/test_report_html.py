"""The HTML report: one self-contained file (no script, nothing fetched from outside), opened in headless
Chromium, whose DOM must carry every section's title and whose screenshot must not be blank. Skips, with
the install command, where Chromium is missing."""

from __future__ import annotations

import re
import subprocess

import pytest

from scalerl.cli import main
from scalerl.report.document import FIRST_PAGE_TITLE, SECTION_TITLES
from scalerl.report.figures import TITLES
from tests.report.recorded import (
    CHROMIUM,
    FLAGS,
    PNG_MIN_STD,
    png_std,
    recorded_report_path,
)


@pytest.fixture(scope="module")
def html_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    path = tmp / "performance_analysis.html"
    assert main(["report", str(recorded_report_path(tmp)), "-o", str(path)]) == 0
    return path


def test_html_is_self_contained(html_report):
    text = html_report.read_text()
    assert "<script" not in text.lower()
    references = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)""", text, flags=re.IGNORECASE)
    assert references and all(r.startswith("data:image/png;base64,") for r in references), references[:3]
    assert not re.search(r"https?://", text)
    assert text.count("<img") >= 8 and text.count("<section") >= 12


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y --no-install-recommends chromium")
def test_html_in_headless_chromium(html_report, tmp_path):
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([CHROMIUM, *FLAGS, *profile, "--dump-dom", html_report.as_uri()], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    titles = [FIRST_PAGE_TITLE, "Headline findings (measured)", "Recommended configuration",
              *(TITLES[k] for k in ("throughput", "efficiency", "latency", "bytes", "memory", "baselines",
                                    "validation", "projection")), *SECTION_TITLES.values()]
    for title in titles:
        assert f">{title}<" in dom, f"the rendered page has no heading {title!r}"
    assert dom.count("data:image/png;base64,") >= 8
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *FLAGS, *profile, f"--screenshot={shot}", "--window-size=1200,2400",
                    html_report.as_uri()], capture_output=True, timeout=120, check=True)
    assert shot.exists() and png_std(shot) > PNG_MIN_STD
