"""How this device's compute time grows with work, measured in the calibration cell: forward + backward of a
micro-batch at two sequence widths, and fixed-length generation at two batch sizes, on the model itself.

Two sizes per phase split a phase's time into a fixed cost per call (a forward + backward, a decode step:
kernel launches, Python, the dispatcher) and a cost per FLOP. On a GPU with a large model the FLOPs
dominate; on this CPU with a small one the fixed part does, and a projection to another shape (a pipeline
stage's share of the layers, tensor parallelism's share of each matmul, fewer rows per rank) has to know
which of the two it is scaling. `scalerl.bench.calibration` fits both from these points.

The device's matmul peak is measured per dtype (`matmul_peaks`): fp32, and bf16 where the device has bf16
matmul hardware (a CPU's avx512_bf16 / amx_bf16), so MFU is read against the peak of the dtype the matmuls
run in and the doctor can say what an fp32 run leaves unused.
"""

from __future__ import annotations

import statistics
import time

import torch

from scalerl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.perf.flops import device_peak_flops
from scalerl.perf.memory import release_host_memory
from scalerl.perf.precision import bf16_hardware
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams

TRAIN_WIDTHS = (24, 96)
GEN_ROWS = (4, 16)
PROMPT_LEN = 12
REPEATS = 5


def _interleaved_median_seconds(fns, repeats: int = REPEATS) -> list[float]:
    """Median seconds of each of ``fns``, timed in turns (a, b, a, b, ...) rather than one after the other: on a
    shared machine the load changes within seconds, and the fit reads the difference between two sizes, so
    both sizes are timed under the same load (a load change between them would read as a cost per FLOP)."""
    for fn in fns:
        fn()  # warm-up: allocations, kernel choice
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def matmul_peaks(device: torch.device) -> dict:
    """Peak matmul FLOP/s per dtype name (bf16 only where the device multiplies in it), the bf16 / fp32 ratio
    and the hardware behind it."""
    hardware = bf16_hardware(device)
    peaks = {"float32": device_peak_flops(device, torch.float32)}
    if hardware:
        peaks["bfloat16"] = device_peak_flops(device, torch.bfloat16)
    out = {"peak_flops": peaks, "bf16_hardware": hardware}
    if hardware:
        out["bf16_over_fp32"] = peaks["bfloat16"] / peaks["float32"]
    return out


def probe_compute(model: torch.nn.Module, pad_token_id: int, micro_rows: int, new_tokens: int,
                  repeats: int = REPEATS, fused_decode: bool = True, accumulate: int | None = None) -> dict:
    """Median seconds of each probe, with the shapes the fit needs. ``fused_decode``: generation as the built-in
    engine runs it over whole weights (its decode layout), or False: with the model's own forward, as it runs
    over sharded or tensor-parallel weights (measured 4-5x slower per step on the 0.5B-shaped plan cell, where a
    plan that probed the fused path predicted an FSDP run's generation at a quarter of its time).
    ``accumulate``: micro-batches per optimizer step (None: one pass, its gradients freed); a training probe
    then runs that many forward + backward passes into the same gradients, frees them and gives the freed
    memory back as the trainer does after its update (`scalerl.perf.memory.release_host_memory`), and counts
    the seconds per pass: the gradients' adds and the pages the next update faults in again are the trainer's
    (on the 0.5B-shaped plan cell: 4 such passes took a median 1.11x four single ones, which free their
    gradients each time and keep the pages)."""
    passes = accumulate or 1
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    out: dict = {"train": [], "forward": [], "gen": [],
                 "matmul_peaks": matmul_peaks(next(model.parameters()).device)}
    model.train()
    trains, forwards = [], []
    for width in TRAIN_WIDTHS:
        ids = torch.randint(3, vocab, (micro_rows, width), generator=generator)
        mask = torch.ones_like(ids)

        # As the trainer's objective reads the logits (`scalerl.trainer.objectives`): each token's log-prob with
        # gradient, its entropy as a metric without; the forward-only pass (old / reference log-probs) the same.
        def train_once(ids=ids, mask=mask):
            for _ in range(passes):
                logits = model(ids, attention_mask=mask).float()
                logp = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
                with torch.no_grad():
                    entropy_from_logits(logits[:, :-1])
                (-(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
                del logits, logp
            model.zero_grad(set_to_none=True)
            if accumulate is not None:
                release_host_memory(ids.device)

        def forward_once(ids=ids, mask=mask):
            with torch.no_grad():
                logits = model(ids, attention_mask=mask).float()
                logprobs_from_logits(logits[:, :-1], ids[:, 1:])
                entropy_from_logits(logits[:, :-1])

        trains.append(train_once)
        forwards.append(forward_once)
    for width, train_s, forward_s in zip(TRAIN_WIDTHS, _interleaved_median_seconds(trains, repeats),
                                         _interleaved_median_seconds(forwards, repeats), strict=True):
        out["train"].append({"rows": micro_rows, "width": width, "seconds": train_s / passes})
        out["forward"].append({"rows": micro_rows, "width": width, "seconds": forward_s})
    model.eval()
    engine = BuiltinEngine(model, pad_token_id, fused=fused_decode)
    out["fused_decode"] = engine.fused
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0, stop_token_ids=())
    prompts = [torch.randint(3, vocab, (rows, PROMPT_LEN), generator=generator).tolist() for rows in GEN_ROWS]
    gens = [lambda p=p: engine.generate(p, sampling) for p in prompts]
    for rows, seconds in zip(GEN_ROWS, _interleaved_median_seconds(gens, repeats), strict=True):
        out["gen"].append({"rows": rows, "prompt_len": PROMPT_LEN, "new_tokens": new_tokens, "seconds": seconds})
    return out
