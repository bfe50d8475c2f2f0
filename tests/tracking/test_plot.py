"""plot_metrics: a readable PNG from metrics.jsonl, and a clear error when no key is present."""

import json

import pytest

from scalerl.tracking import plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_plot_writes_a_readable_png(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    jsonl = tmp_path / "metrics.jsonl"
    write_jsonl(jsonl, [{"step": s, "critic/score/mean": s / 10} for s in range(1, 6)] + [{"step": 5, "val/accuracy": 0.4}])
    png = plot_metrics(jsonl, tmp_path / "plots" / "reward.png", title="demo")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = image.imread(png).shape
    assert height > width / 2  # two stacked subplots


def test_plot_without_known_keys_lists_what_the_file_has(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    write_jsonl(jsonl, [{"step": 1, "actor/pg_loss": 0.1}])
    with pytest.raises(ValueError, match=r"critic/score/mean.*actor/pg_loss"):
        plot_metrics(jsonl, tmp_path / "out.png")
