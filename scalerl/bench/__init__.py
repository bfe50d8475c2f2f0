"""`scalerl bench`: a matrix of layouts measured into `benchmark_report.json`, baselines beside them, and a
cost model calibrated from the measurements that projects to other clusters (docs/bench.md).

Public pieces: `BenchMatrix` (the axes), `run_bench` (measure), `project` tables (`scalerl.bench.projection`),
`compare_reports` (two reports, cell by cell, with a noise band)."""

from scalerl.bench.matrix import BenchMatrix, Cell

__all__ = ["BenchMatrix", "Cell"]
