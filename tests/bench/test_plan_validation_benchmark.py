"""benchmarks/plan_validation.py's verdict per cell, without runs: every repeat against the targets, and the
median of the repeats."""

from __future__ import annotations


def test_a_cell_is_met_in_every_repeat_or_by_its_median(repo_script):
    bench = repo_script("benchmarks/plan_validation.py")
    noisy = bench.cell_verdict([0.26, -0.11, -0.17], [-0.0, -0.01, 0.0])
    assert not noisy["step_met"] and noisy["step_median_met"] and noisy["step_median"] == -0.11
    assert noisy["memory_met"] and noisy["memory_median_met"]
    off = bench.cell_verdict([-0.31, -0.25, 0.1], [-0.11, -0.12, -0.05])
    assert not off["step_median_met"] and off["step_median"] == -0.25
    assert not off["memory_met"] and not off["memory_median_met"]
    missing = bench.cell_verdict([0.05, None], [])  # a repeat without a measurement misses both ways
    assert not missing["step_met"] and not missing["step_median_met"] and not missing["memory_met"]
