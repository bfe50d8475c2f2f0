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
    assert out["fused_decode"] is True  # the built-in engine's decode layout, as a run over whole weights
    # over sharded / tensor-parallel weights a run decodes with the model's own forward: so does the probe
    calls = []
    real_forward = compute_probe.BuiltinEngine.__init__

    def spy(self, *args, **kwargs):
        real_forward(self, *args, **kwargs)
        calls.append(self.fused)

    monkeypatch.setattr(compute_probe.BuiltinEngine, "__init__", spy)
    unfused = compute_probe.probe_compute(tiny_model(), pad_token_id=0, micro_rows=2, new_tokens=2, fused_decode=False)
    assert unfused["fused_decode"] is False and calls == [False]


def test_the_sizes_of_a_phase_are_timed_in_turns(monkeypatch):
    # a load that doubles every call's time halfway through the probe: timed in turns, both sizes see it
    # alike, so their difference (what the fit reads as a cost per FLOP) stays the true one
    clock = {"t": 0.0, "calls": 0}

    def work(cost):
        def run():
            clock["calls"] += 1
            clock["t"] += cost * (2.0 if clock["calls"] > 6 else 1.0)
        return run

    monkeypatch.setattr(compute_probe.time, "perf_counter", lambda: clock["t"])
    small, large = compute_probe._interleaved_median_seconds([work(1.0), work(3.0)], repeats=4)
    assert [small, large] == [1.5, 4.5]  # medians of (1, 1, 2, 2) and (3, 3, 6, 6): the ratio kept at 3


def test_a_training_probe_accumulates_as_the_trainer_and_counts_seconds_per_pass(monkeypatch):
    # accumulate=3: three forward + backward passes into the same gradients per timed call, then the gradients
    # freed and the memory given back (once per call), the seconds divided by 3
    from tests.tiny import tiny_model

    model = tiny_model()
    monkeypatch.setattr(compute_probe, "matmul_peaks", lambda device: {})
    trims, held = [], []
    monkeypatch.setattr(compute_probe, "release_host_memory", lambda device: trims.append(device))
    real = model.forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():  # a training pass (the forward-only probe runs without gradients)
            held.append(next(model.parameters()).grad is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    seconds = iter([0.0, 3.0] * 100)  # every timed call takes 3 s
    monkeypatch.setattr(compute_probe.time, "perf_counter", lambda: next(seconds))
    out = compute_probe.probe_compute(model, pad_token_id=0, micro_rows=2, new_tokens=2, repeats=1, accumulate=3)
    calls = len(compute_probe.TRAIN_WIDTHS) * 2  # an untimed warm-up and one timed turn per width
    assert held == [False, True, True] * calls and len(trims) == calls
    assert all(p.grad is None for p in model.parameters())
    assert [p["seconds"] for p in out["train"]] == [1.0] * len(compute_probe.TRAIN_WIDTHS)
