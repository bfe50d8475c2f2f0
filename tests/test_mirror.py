"""The tests mirror the package: every directory under tests/ is the test directory of the package at the
same path under scalerl/ (tests/comm -> scalerl/comm, tests/bench/cost_model -> scalerl/bench/cost_model),
so a package's tests are found in one step. Suites that cut across the package, and data, are named
below with their reason; a test of one package goes in that package's directory."""

from __future__ import annotations

from pathlib import Path

import scalerl

PACKAGE = Path(scalerl.__file__).parent
TESTS = Path(__file__).parent

# Directory under tests/ (with everything below it) -> why it mirrors no package.
EXCEPTIONS = {
    "bad_inputs": "the bad-input corpus: every entry point at once (CLI, config, data, model files)",
    "special_e2e": "end-to-end checks run outside pytest (run_test.sh: verify distributed-vs-single)",
    "utils": "the seed article's benchmark command keeps its path as written (utils/profiler, a script)",
    "launch/golden": "data: the manifests test_k8s.py compares against",
    "launch/k8s_schemas": "data and its validator: the published schemas test_k8s.py checks manifests with",
}


def _test_directories() -> list[str]:
    return sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("*")
                  if p.is_dir() and "__pycache__" not in p.parts)


def _excepted(directory: str) -> bool:
    return any(directory == e or directory.startswith(e + "/") for e in EXCEPTIONS)


def test_every_test_directory_mirrors_a_package():
    unmirrored = [d for d in _test_directories()
                  if not _excepted(d) and not (PACKAGE / d / "__init__.py").is_file()]
    assert not unmirrored, (f"test directories with no package at the same path under scalerl/: {unmirrored}; "
                            "move their tests to the directory of the package they test")


def test_every_exception_is_still_there_and_says_why():
    stale = [e for e in EXCEPTIONS if not (TESTS / e).is_dir()]
    assert not stale, f"exceptions naming no directory under tests/: {stale}"
    assert all(reason.strip() for reason in EXCEPTIONS.values())
    assert not [e for e in EXCEPTIONS if (PACKAGE / e / "__init__.py").is_file()], "an exception mirrors a package"


def test_test_modules_at_the_root_test_root_modules_or_the_whole_package():
    """tests/test_<name>.py at the root: scalerl/<name>.py, or a check across the tree (named, with why)."""
    across = {
        "test_layers": "the import layers of every module",
        "test_docs_links": "every relative link and anchor of README.md and docs/",
        "test_mirror": "the test tree's shape (this file)",
        "test_examples": "examples/ at the repository root: the configs, the seed article's launch script",
        "test_train_cli_files": "the user's path through cli.py: sft then train on JSONL files",
        "test_gpu_selftest": "scripts/gpu_selftest.sh at the repository root: its CPU run (every check SKIPs)",
        "test_spawned_group": "tests/spawned_group.py, the multi-process harness every spawned test shares",
        "test_readme_tour": "README.md's five-minute tour: its commands run, their output against what it shows",
    }
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    assert set(across) <= modules, f"named but gone: {sorted(set(across) - modules)}"
    astray = sorted(m for m in modules - set(across) if not (PACKAGE / f"{m.removeprefix('test_')}.py").is_file())
    assert not astray, f"root test modules matching no root module of scalerl: {astray}"
