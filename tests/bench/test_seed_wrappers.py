"""The seed article's two commands as written: how each wrapper translates its options for the scalerl CLI,
and that pytest never collects the benchmark script despite its test_-name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_benchmark_wrapper_translates_the_seed_options(repo_script):
    bench = repo_script("tests/utils/profiler/test_performance_benchmark.py")
    argv = bench.build_argv(["--num_nodes", "4", "--iterations", "100", "--output_report", "benchmark_report.json"])
    assert argv[:3] == ["bench", "--nodes", "1,2,4"]
    assert argv[argv.index("--steps") + 1] == "100" and argv[argv.index("-o") + 1] == "benchmark_report.json"
    assert bench.node_counts(6) == [1, 2, 4, 6] and bench.node_counts(1) == [1]
    extra = bench.build_argv(["--num_nodes", "2", "--set", "rollout.n=2", "--weight-sync", "full,delta"])
    assert extra[-4:] == ["--set", "rollout.n=2", "--weight-sync", "full,delta"]  # the rest goes to scalerl bench
    assert not [name for name in dir(bench) if name.startswith("test")]  # nothing pytest could run


def test_analyzer_wrapper_translates_the_seed_options(repo_script):
    analyzer = repo_script("scripts/performance_analyzer.py")
    assert analyzer.build_argv(["--input", "benchmark_report.json", "--output", "performance_analysis.pdf"]) == \
        ["report", "benchmark_report.json", "-o", "performance_analysis.pdf"]


def test_pytest_does_not_collect_the_benchmark_script():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/utils"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert "test_performance_benchmark" not in done.stdout and done.returncode == 5, done.stdout  # 5: none collected


def test_wrappers_run_as_scripts():
    for script in ("tests/utils/profiler/test_performance_benchmark.py", "scripts/performance_analyzer.py"):
        done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0 and "--output" in done.stdout, done.stderr
