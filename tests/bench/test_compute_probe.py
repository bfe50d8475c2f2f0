"""The compute probe's per-dtype matmul peaks: bf16 measured only where the device multiplies in it."""

from __future__ import annotations

import torch

from scalerl.bench import compute_probe

CPU = torch.device("cpu")


def test_bf16_peak_and_ratio_only_with_bf16_hardware(monkeypatch):
    peaks = {torch.float32: 1e11, torch.bfloat16: 4e11}
    monkeypatch.setattr(compute_probe, "device_peak_flops", lambda device, dtype: peaks[dtype])
    monkeypatch.setattr(compute_probe, "bf16_hardware", lambda device: "avx512_bf16")
    assert compute_probe.matmul_peaks(CPU) == {"peak_flops": {"float32": 1e11, "bfloat16": 4e11},
                                               "bf16_hardware": "avx512_bf16", "bf16_over_fp32": 4.0}
    monkeypatch.setattr(compute_probe, "bf16_hardware", lambda device: "")
    assert compute_probe.matmul_peaks(CPU) == {"peak_flops": {"float32": 1e11}, "bf16_hardware": ""}


def test_the_probe_reports_the_matmul_peaks_beside_its_timings(monkeypatch):
    from tests.tiny import tiny_model

    monkeypatch.setattr(compute_probe, "REPEATS", 1)
    monkeypatch.setattr(compute_probe, "matmul_peaks", lambda device: {"peak_flops": {"float32": 1.0}})
    out = compute_probe.probe_compute(tiny_model(), pad_token_id=0, micro_rows=2, new_tokens=2)
    assert out["matmul_peaks"] == {"peak_flops": {"float32": 1.0}}
    assert [p["width"] for p in out["train"]] == list(compute_probe.TRAIN_WIDTHS) and len(out["gen"]) == 2
