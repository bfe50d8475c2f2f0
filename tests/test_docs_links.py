"""Every relative link in README.md and docs/*.md reaches an existing file, and every `#anchor` a heading of
the page it points at (headings slugged as GitHub renders them), so moving a section cannot leave a link
dangling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code spans blanked (links and headings in
    code are not links and headings)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: code marks and links reduced to their text, lower case, punctuation
    other than `-` and `_` dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(page.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    found = []
    for line in _prose_lines(page.read_text()):
        found += LINK.findall(CODE_SPAN.sub("", line))
    return found


def test_slugs_follow_github():
    assert _slug("Algorithms (`scalerl/algorithms`)") == "algorithms-scalerlalgorithms"
    assert _slug("`--distributed-check`, 4 ranks under torchrun") == "--distributed-check-4-ranks-under-torchrun"
    assert _slug("6. Resume under another layout or world size (resharding)") == \
        "6-resume-under-another-layout-or-world-size-resharding"


def test_pages_have_links_to_check():
    # the map in the README links every page of docs/; a regex that found nothing would pass vacuously
    readme_links = {link.split("#")[0] for link in _links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme_links]
    assert not missing, f"docs pages the README's map does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
