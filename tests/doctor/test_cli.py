"""The seed article's commands as written: `python scripts/diagnose.py --distributed-check
--performance-profiling` under torchrun (2 ranks), `--performance-profiling` with a trace and the
distributed check in one process (also as the hardware pre-check of a bf16 config on a CPU without bf16
instructions), with the tree on stdout and the JSON report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from scalerl.cli import main
from scalerl.core.net import free_port
from scalerl.doctor.cli import parse_size
from tests.tiny import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "diagnose.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
TINY = tiny_overrides("data.num_train=100", "data.num_val=4")


def test_both_modes_under_torchrun(tmp_path):
    report = tmp_path / "doctor.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(SCRIPT), "--distributed-check", "--max-size", "1MiB", "--iters", "2", "--json", str(report),
           "--performance-profiling", *TINY, "--steps", "2", "--warmup", "1", "--scratch-dir", str(tmp_path / "scratch"),
           f"trainer.output_dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "library version mismatch [ok]" in done.stdout and "insufficient network bandwidth [ok]" in done.stdout
    assert "exit code 0: no fault" in done.stdout and done.stdout.count("scalerl doctor [") == 1  # rank 0 prints
    data = json.loads(report.read_text())
    assert data["schema"] == "scalerl.doctor/1" and data["modes"] == ["distributed-check", "performance-profiling"]
    assert data["world"]["joined"] == [0, 1] and data["ranks"][1]["launcher"] == "torchrun"
    assert data["ranks"][0]["env"]["TORCHELASTIC_USE_AGENT_STORE"] in ("True", "False")
    assert [r["rank"] for r in data["measurements"]["profile"]["per_rank"]] == [0, 1]
    assert data["status"] == "ok"


def test_distributed_check_in_one_process(tmp_path, capsys):
    assert main(["doctor", "--json", str(tmp_path / "one.json"), f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    assert "scalerl doctor [ok]" in capsys.readouterr().out
    data = json.loads((tmp_path / "one.json").read_text())
    assert data["modes"] == ["distributed-check"] and data["world"]["launcher"] == "single"
    bandwidth = next(leaf for b in data["tree"] for leaf in b["leaves"] if leaf["id"] == "communication/bandwidth")
    assert bandwidth["status"] == "not measured" and "one rank" in bandwidth["findings"][0]["summary"]


def test_distributed_check_warns_of_bf16_on_a_cpu_without_bf16_instructions(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SCALERL_CPU_ISA", "avx2")  # every machine's CPU then reads as one without bf16 matmuls
    assert main(["doctor", "--distributed-check", "--json", str(tmp_path / "bf16.json"), "trainer.precision=bf16",
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 0  # a warning: it runs, slowly
    out = capsys.readouterr().out
    assert "scalerl doctor [WARNING]" in out and "compute precision [WARNING]" in out
    assert "trainer.precision=bf16 on rank(s) 0" in out and "fix: trainer.precision=fp32" in out
    # the instruction-set line of the rank: its ISA level, flags, and no bf16/fp16 matmul instructions
    assert "instruction sets" in out and re.search(r"\s0\s.*\savx2\s.*\snone\s+none\s", out), out
    data = json.loads((tmp_path / "bf16.json").read_text())
    (precision,) = [leaf for b in data["tree"] for leaf in b["leaves"] if leaf["id"] == "compute/precision"]
    (f,) = [f for f in precision["findings"] if f["status"] == "warning"]
    assert precision["status"] == "warning" and f["rule"] == "cpu_precision" and f["ranks"] == [0]
    assert f["evidence"]["lacks"] == ["amx_bf16", "avx512_bf16"] and f["evidence"]["isa_level"] == "avx2"
    assert data["ranks"][0]["cpu"]["bf16_matmul"] == [] and data["ranks"][0]["cpu"]["level"] == "avx2"


def test_performance_profiling_single_process(tmp_path):
    report = tmp_path / "profile.json"
    cmd = [sys.executable, str(SCRIPT), "--performance-profiling", *TINY, "--steps", "1", "--warmup", "0",
           "--scratch-dir", str(tmp_path / "scratch"), "--trace", str(tmp_path / "traces"), "--json", str(report)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "per rank and phase" in done.stdout and "data sharding imbalance [ok]" in done.stdout
    data = json.loads(report.read_text())
    (record,) = data["measurements"]["profile"]["per_rank"]
    assert record["phases"]["gen"]["time_s"] > 0 and record["step_s"] > 0
    trace = json.loads((tmp_path / "traces" / "rank0.json").read_text())
    assert trace["traceEvents"]
    assert not (tmp_path / "outputs" / "run").exists()  # the profile wrote only to its scratch directory


def test_list_rules_and_bad_arguments(capsys):
    assert main(["doctor", "--list-rules"]) == 0
    out = capsys.readouterr().out
    assert "stragglers  ->  compute/stragglers" in out and "busy_over_median: warning > 1.3x median" in out
    assert main(["doctor", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert parse_size("256MiB") == 256 * 2**20 and parse_size("1G") == 2**30 and parse_size("4096") == 4096
