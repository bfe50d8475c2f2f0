"""The `parallel` section's choice of pipeline schedules agrees with the pipeline's own (layouts against
the model and the other sections are checked in `root`: tests/core/config/test_root.py)."""

from __future__ import annotations

from scalerl.core.config.parallel import PP_SCHEDULES


def test_pipeline_schedules():
    from scalerl.parallel.pipeline import SCHEDULES

    assert set(PP_SCHEDULES) == set(SCHEDULES)
