"""scripts/gpu_selftest.sh on a machine without CUDA: every check prints one line, the CUDA ones SKIP
naming the reason, and it exits 0 (the checks themselves run only where a GPU is; docs/performance.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks would run for real")
def test_selftest_skips_cuda_checks_without_cuda():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_selftest.sh")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_selftest import CHECKS

    assert len(lines) == len(CHECKS)
    for line, (name, _) in zip(lines, CHECKS):
        assert line.startswith(f"SKIP {name}: no CUDA"), line


def test_a_failing_check_is_reported_and_exits_1(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_selftest

    def broken() -> str:
        raise AssertionError("measured 0 tokens")

    monkeypatch.setattr(gpu_selftest, "CHECKS", [("broken", broken), ("fine", lambda: "ok")])
    assert gpu_selftest.run_checks(budget_s=60) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAIL broken: AssertionError: measured 0 tokens") and out[1].startswith("PASS fine: ok")
