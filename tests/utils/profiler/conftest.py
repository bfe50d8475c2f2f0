"""test_performance_benchmark.py carries the seed article's name but is a script (the benchmark command),
not a test module: pytest must not collect it."""

collect_ignore = ["test_performance_benchmark.py"]
