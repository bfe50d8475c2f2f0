"""The report as one self-contained HTML file: figures embedded as base64 PNG data, styles inline, no script
and no reference to anything outside the file, so it opens offline and fetches nothing."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib.pyplot as plt

from scalerl.report.document import Document
from scalerl.report.figures import TITLES

STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; font-size: 0.9em; }
section { margin: 2em 0; } img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.75em; }
.rec { background: #eef6ee; padding: 0.8em 1em; border-left: 4px solid #4a4; }
code { background: #eee; padding: 0 0.3em; }
"""


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def render_html(doc: Document) -> str:
    e = html.escape
    rec = doc.recommendation
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>{e(doc.title)}</title><style>{STYLE}</style></head><body>",
        f"<section id='findings'><h1>{e(doc.title)}</h1><p class='sub'>{e(doc.subtitle)}</p>",
        "<h2>Headline findings (measured)</h2><ul>",
        *(f"<li>{e(line)}</li>" for line in doc.headlines), "</ul>",
        "<h2>Recommended configuration</h2>", f"<p class='sub'>{e(doc.target)}</p><div class='rec'>",
        (f"<p><b>strategy</b> <code>{e(str(rec.get('strategy') or '-'))}</code> &nbsp; <b>gradient compression</b> "
         f"<code>{e(rec['compression'])}</code> &nbsp; <b>weight sync</b> <code>{e(rec['weight_sync'])}</code></p><ul>"),
        *(f"<li>{e(line)}</li>" for line in rec["reasoning"]), "</ul></div></section>",
    ]
    for key, fig in doc.figures:
        parts.append(f"<section id='{key}'><h2>{e(TITLES[key])}</h2>"
                     f"<img alt='{e(TITLES[key])}' src='data:image/png;base64,{_png(fig)}'></section>")
    for section in doc.sections:
        parts.append(f"<section id='{section.key}'><h2>{e(section.title)}</h2><pre>{e(section.text)}</pre></section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(doc: Document, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(doc), encoding="utf-8")
    tmp.replace(path)
    return path
